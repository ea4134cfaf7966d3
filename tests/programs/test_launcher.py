"""The launcher's error-to-exit-code map in use (:func:`lopd_jax.programs.launcher.exit_on_error`)
and the compile checks' map (the programs' user errors, 3 for a host that cannot compile)."""

import pytest

from lopd_jax.programs.launcher import USER_ERROR_EXITS, exit_on_error


def _raise(error):
    raise error


def test_exit_on_error_returns_the_result_or_the_mapped_status(capsys):
    assert exit_on_error({ValueError: 2}, lambda a, b: a + b, 1, 2) == (3, None)
    assert capsys.readouterr().err == ""
    assert exit_on_error({KeyError: 4, LookupError: 5}, _raise, IndexError("no row 7")) == (None, 5)
    assert capsys.readouterr().err == "error: no row 7\n"
    assert exit_on_error({LookupError: 5, KeyError: 4}, _raise, KeyError("k")) == (None, 5)  # the first match
    with pytest.raises(RuntimeError, match="not mapped"):
        exit_on_error({ValueError: 2}, _raise, RuntimeError("not mapped"))


def test_compile_checks_map_user_errors_to_2_and_cannot_compile_to_3(capsys):
    from lopd_jax.programs.compile_check import (ERROR_EXITS, EXIT_BAD_ARGS, EXIT_CANNOT_COMPILE,
                                                 CannotCompileHere)

    assert EXIT_BAD_ARGS == 2 and EXIT_CANNOT_COMPILE == 3
    assert all(ERROR_EXITS[cls] == code for cls, code in USER_ERROR_EXITS.items())
    cases = [(ValueError("bad key"), 2), (FileNotFoundError("no such file"), 2),
             (CannotCompileHere("no libtpu"), 3)]
    for error, code in cases:
        assert exit_on_error(ERROR_EXITS, _raise, error) == (None, code)
        assert capsys.readouterr().err == f"error: {error}\n"
