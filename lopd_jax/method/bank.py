"""The experience bank: admission, observation-lite linearization, FAISS retrieval.

Life cycle: ``add`` successful rollouts (reward >= ``min_reward``), ``build`` once (embeds
every entry into a FAISS ``IndexFlatIP`` over L2-normalized vectors and freezes the bank),
then ``retrieve`` n_ret experiences per task for the composer. ``save`` / ``load`` write
and read a bank directory (local or any tensorstore kvstore URL such as ``gs://``)::

    manifest.json   format version, embedder spec (name, dim, ...), config, entry count
    entries.jsonl   one Experience per line, in index order
    index.faiss     faiss.serialize_index bytes

Retrieval modes: ``symmetric`` (the release's; default) embeds the instruction on both
sides; ``asymmetric`` (the paper's) embeds document = task + trajectory and query = task.
The method: docs/method.md, "Experience bank".
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Collection, Sequence
from typing import Any, Literal

import faiss
import numpy as np
import tensorstore as ts

from lopd_jax.method.embedders import Embedder, build_embedder
from lopd_jax.core.types import Message

FORMAT_VERSION = 1
RETRIEVAL_MODES = ("symmetric", "asymmetric")
MISSING_HITS = ("mask", "repeat")
ENCODER_INPUT_TEMPLATE = "Task to solve:\n{task}\n\nReference past trajectory:\n{linearized}"


@dataclasses.dataclass
class Experience:
    """One admitted rollout.

    ``messages`` is the trajectory in the chat-message convention of
    :mod:`lopd_jax.core.types` (system, user task, assistant turns with ``tool_calls``, tool /
    user observations). ``token_ids`` optionally keeps the exact sampled ids;
    ``info`` holds free-form JSON metadata (family, group index, ...).
    """

    task_id: str
    env_id: str
    instruction: str
    messages: list[Message]
    reward: float
    token_ids: list[int] | None = None
    info: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> str:
        """One JSON line (raises a clear error on non-JSON content)."""
        try:
            return json.dumps(dataclasses.asdict(self), ensure_ascii=False)
        except TypeError as e:
            raise TypeError(
                f"Experience {self.task_id!r} is not JSON-serializable ({e}); messages must "
                "be plain dicts/lists/str/numbers as in lopd_jax.core.types.") from e

    @classmethod
    def from_json(cls, line: str) -> Experience:
        """Inverse of :meth:`to_json`."""
        return cls(**json.loads(line))


@dataclasses.dataclass(frozen=True)
class BankSettings:
    """The bank's own settings (docs/method.md, "Experience bank"): :class:`BankConfig`
    without ``n_ret``, which a run takes from its composer (``composer.n_ret``); the run config's ``bank`` section
    (:class:`lopd_jax.settings.config.BankSection`) is these fields plus the embedder and paths.

    ``min_reward`` is ``bank_min_reward``; ``extra_candidates`` is the "+10" of the
    k + 10 candidate search; ``max_obs_chars`` truncates observations in the
    linearization (``None`` keeps them whole). ``missing_hits``: when fewer than n_ret
    entries are usable, ``mask`` (the release) returns fewer experiences (their latent
    slots are masked out of the teacher's attention); ``repeat`` repeats the hits in order.
    """

    min_reward: float = 1.0
    retrieval_mode: Literal[RETRIEVAL_MODES] = "symmetric"
    allow_self_retrieval: bool = True
    extra_candidates: int = 10
    max_obs_chars: int | None = 300
    missing_hits: Literal[MISSING_HITS] = "mask"


@dataclasses.dataclass(frozen=True)
class BankConfig(BankSettings):
    """Bank settings (docs/method.md, "Experience bank"): :class:`BankSettings` plus
    ``n_ret``, the experiences retrieved per task."""

    n_ret: int = 3

    def __post_init__(self):
        if self.missing_hits not in MISSING_HITS:
            raise ValueError(f"missing_hits={self.missing_hits!r}; choose one of {MISSING_HITS}.")
        if self.retrieval_mode not in RETRIEVAL_MODES:
            raise ValueError(f"retrieval_mode={self.retrieval_mode!r}; choose one of "
                             f"{RETRIEVAL_MODES}.")
        if self.n_ret < 1 or self.extra_candidates < 0:
            raise ValueError(f"n_ret={self.n_ret} must be >= 1 and extra_candidates="
                             f"{self.extra_candidates} >= 0.")
        if self.max_obs_chars is not None and self.max_obs_chars < 1:
            raise ValueError(f"max_obs_chars={self.max_obs_chars} must be >= 1 or None.")


class EmptyBankError(ValueError):
    """The bank holds no experience, so there is nothing to retrieve."""


# ----------------------------------------------------------------------------- linearize

_THINK_RE = re.compile(r"<think>.*?</think>", re.DOTALL)


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # multimodal-style content parts
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def _one_line(s: str) -> str:
    return " ".join(s.split())


def _truncate(s: str, limit: int | None) -> str:
    if limit is None or len(s) <= limit:
        return s
    return s[:limit] + f"... [{len(s) - limit} chars cut]"


def _action(msg: Message) -> str:
    calls = []
    for call in msg.get("tool_calls") or []:
        fn = call.get("function", call)
        args = fn.get("arguments", {})
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False, sort_keys=True)
        calls.append(f"{fn.get('name', '?')}({args})")
    if calls:
        return "; ".join(calls)
    return _THINK_RE.sub("", _text(msg.get("content")))


def linearize(experience: Experience, max_obs_chars: int | None = 300,
              max_action_chars: int | None = None) -> str:
    """Observation-lite text of a trajectory: the task, then one line per step.

    Each assistant turn is a step, written ``"Step i: action -> result"``: the action is
    its tool calls ``name({json args})`` (or its text when it calls nothing); the result is
    the tool / user messages that follow it, joined with " | ", whitespace collapsed, cut
    to ``max_obs_chars`` characters (a marker says how many were cut). System messages and
    the first user message (the task itself) are not steps.
    """
    lines = [f"Task: {_one_line(experience.instruction)}"]
    msgs = list(experience.messages)
    i = 0
    while i < len(msgs) and msgs[i].get("role") != "assistant":
        i += 1  # skip system prompt and the task message
    step = 0
    while i < len(msgs):
        msg = msgs[i]
        i += 1
        if msg.get("role") != "assistant":
            continue
        obs = []
        while i < len(msgs) and msgs[i].get("role") in ("tool", "user"):
            obs.append(_one_line(_text(msgs[i].get("content"))))
            i += 1
        step += 1
        action = _truncate(_one_line(_action(msg)), max_action_chars)
        result = _truncate(" | ".join(obs), max_obs_chars) if obs else "(end)"
        lines.append(f"Step {step}: {action} -> {result}")
    return "\n".join(lines)


def encoder_input_text(task: str, experience: Experience,
                       max_obs_chars: int | None = 300) -> str:
    """The composer encoder's input for one retrieved ``experience`` given the current task."""
    return ENCODER_INPUT_TEMPLATE.format(
        task=task, linearized=linearize(experience, max_obs_chars=max_obs_chars))


# ----------------------------------------------------------------------------- file IO

class _Store:
    """Byte files in one directory through tensorstore's kvstore.

    A plain local path becomes a ``file://`` kvstore; any URL tensorstore understands
    (``gs://bucket/dir``, ``file://...``, ``memory://``) is used as given, so remote
    storage needs no other code path.
    """

    def __init__(self, path: str):
        path = os.fspath(path)
        url = path if "://" in path else "file://" + os.path.abspath(path)
        self.url = url.rstrip("/") + "/"
        self._kv = ts.KvStore.open(self.url).result()

    def write(self, name: str, data: bytes) -> None:
        self._kv.write(name, data).result()

    def read(self, name: str) -> bytes:
        res = self._kv.read(name).result()
        if res.state != "value":
            raise FileNotFoundError(f"{self.url}{name} does not exist.")
        return bytes(res.value)


# ----------------------------------------------------------------------------- bank

def without_clusters(experiences: Sequence[Experience], clusters: Sequence[str],
                     withhold: Collection[str]) -> list[Experience]:
    """The ``experiences`` whose task's cluster key (``clusters``, one per experience) is not
    in ``withhold``: a bank built from them holds no success of those clusters, and retrieval
    for their tasks can only surface other clusters' experiences."""
    if len(clusters) != len(experiences):
        raise ValueError(f"{len(clusters)} cluster keys for {len(experiences)} experiences; give one key each")
    return [e for e, c in zip(experiences, clusters) if c not in withhold]


class ExperienceBank:
    """Experience bank with FAISS ``IndexFlatIP`` retrieval; frozen once built.

    Args:
      embedder: the text embedder (its ``dim`` fixes the index width).
      config: a :class:`BankConfig`; keyword overrides (e.g. ``min_reward=0.5``) are
        applied on top.
    """

    def __init__(self, embedder: Embedder, config: BankConfig | None = None, **overrides: Any):
        self.embedder = embedder
        self.config = dataclasses.replace(config or BankConfig(), **overrides)
        self._entries: list[Experience] = []
        self._index: faiss.IndexFlatIP | None = None
        self.num_offered = 0  # rollouts offered to add(), admitted or not

    # -- building
    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, i: int) -> Experience:
        return self._entries[i]

    @property
    def entries(self) -> tuple[Experience, ...]:
        """All entries in index order (read-only view)."""
        return tuple(self._entries)

    @property
    def frozen(self) -> bool:
        """True once :meth:`build` (or :meth:`load`) has made the index."""
        return self._index is not None

    def add(self, experience: Experience) -> bool:
        """Offer one rollout; admit it iff ``reward >= min_reward``. Returns whether admitted."""
        if self.frozen:
            raise RuntimeError("The experience bank is frozen (built or loaded); it cannot "
                               "take new entries. Build a new bank to change its contents.")
        if not isinstance(experience, Experience):
            raise TypeError(f"add() takes an Experience, got {type(experience).__name__}.")
        self.num_offered += 1
        if not float(experience.reward) >= self.config.min_reward:
            return False
        self._entries.append(experience)
        return True

    def add_many(self, experiences: Sequence[Experience]) -> int:
        """Offer several rollouts; returns how many were admitted."""
        return sum(self.add(e) for e in experiences)

    def document_text(self, experience: Experience) -> str:
        """What the index embeds for ``experience`` under the configured retrieval mode."""
        if self.config.retrieval_mode == "asymmetric":
            return linearize(experience, max_obs_chars=self.config.max_obs_chars)
        return experience.instruction

    def _empty_error(self) -> EmptyBankError:
        return EmptyBankError(
            f"The experience bank is empty: {self.num_offered} rollouts were offered and none "
            f"reached bank_min_reward={self.config.min_reward}. Lower bank_min_reward, "
            "collect more rollouts (more tasks or a larger group size), or warm up the model "
            "(e.g. SFT / an easier task split) so some rollouts succeed.")

    def build(self) -> ExperienceBank:
        """Embed every entry, fill the FAISS index and freeze the bank. Returns ``self``."""
        if self.frozen:
            raise RuntimeError("The experience bank is already built.")
        if not self._entries:
            raise self._empty_error()
        docs = [self.document_text(e) for e in self._entries]
        vecs = self.embedder.embed_documents(docs)
        index = faiss.IndexFlatIP(int(self.embedder.dim))
        index.add(np.ascontiguousarray(vecs, dtype=np.float32))
        self._index = index
        return self

    # -- retrieval
    def _embed_queries(self, instructions: list[str]) -> np.ndarray:
        if self.config.retrieval_mode == "asymmetric":
            return self.embedder.embed_queries(instructions)
        return self.embedder.embed_documents(instructions)

    def _is_self(self, entry: Experience, instruction: str, task_id: str | None) -> bool:
        return entry.instruction == instruction or (
            task_id is not None and entry.task_id == task_id)

    def retrieve_indices(self, instructions: Sequence[str],
                         task_ids: Sequence[str] | None = None,
                         n_ret: int | None = None) -> np.ndarray:
        """Bank indices ``[len(instructions), n_ret]`` of the retrieved experiences.

        Searches ``n_ret + extra_candidates`` nearest neighbours by inner product; unless
        ``allow_self_retrieval``, drops entries with the query's task id or the exact same
        instruction text (widening the search while too few remain). Keeps the best
        ``n_ret`` in score order; when fewer are available, the row ends in -1 entries
        (``missing_hits="mask"``: ``[a, b] -> [a, b, -1]``) or repeats them in order
        (``"repeat"``: ``[a, b] -> [a, b, a]``).
        """
        if not self.frozen:
            if not self._entries:
                raise self._empty_error()
            raise RuntimeError("Call build() on the experience bank before retrieve().")
        if isinstance(instructions, str):
            raise TypeError("retrieve() takes a list of instructions; wrap one as [text].")
        instructions = list(instructions)
        if task_ids is not None:
            task_ids = list(task_ids)
            if len(task_ids) != len(instructions):
                raise ValueError(f"got {len(task_ids)} task_ids for {len(instructions)} "
                                 "instructions; pass one per instruction or None.")
        n_ret = self.config.n_ret if n_ret is None else int(n_ret)
        if n_ret < 1:
            raise ValueError(f"n_ret={n_ret} must be >= 1.")
        out = np.zeros((len(instructions), n_ret), np.int64)
        if not instructions:
            return out
        queries = self._embed_queries(instructions)
        total = self._index.ntotal
        k = min(n_ret + self.config.extra_candidates, total)
        pending = list(range(len(instructions)))
        while pending:
            _, idx = self._index.search(queries[pending], k)
            still = []
            for row, q in zip(idx, pending):
                kept = [int(j) for j in row if j >= 0]
                if not self.config.allow_self_retrieval:
                    tid = task_ids[q] if task_ids is not None else None
                    kept = [j for j in kept
                            if not self._is_self(self._entries[j], instructions[q], tid)]
                if len(kept) < n_ret and k < total:
                    still.append(q)  # self-matches crowded the candidates out: widen
                    continue
                if not kept:
                    raise EmptyBankError(
                        f"No bank entry is usable for task {instructions[q][:80]!r}: every "
                        "entry is the task itself and allow_self_retrieval is False. Allow "
                        "self-retrieval or add successful rollouts of other tasks.")
                if self.config.missing_hits == "repeat":
                    out[q] = [kept[i % len(kept)] for i in range(n_ret)]
                else:
                    out[q] = kept[:n_ret] + [-1] * max(0, n_ret - len(kept))
            pending = still
            k = min(2 * k, total)
        return out

    def retrieve(self, instructions: Sequence[str], task_ids: Sequence[str] | None = None,
                 n_ret: int | None = None) -> list[list[Experience]]:
        """The retrieved experiences per instruction (see :meth:`retrieve_indices`); a row
        holds fewer than n_ret when the bank has fewer usable entries (``missing_hits="mask"``)."""
        idx = self.retrieve_indices(instructions, task_ids, n_ret)
        return [[self._entries[j] for j in row if j >= 0] for row in idx]

    # -- persistence
    def save(self, path: str) -> None:
        """Write the built bank to directory ``path`` (local path or kvstore URL)."""
        if not self.frozen:
            raise RuntimeError("Build the experience bank before saving it.")
        store = _Store(path)
        store.write("index.faiss", faiss.serialize_index(self._index).tobytes())
        lines = "".join(e.to_json() + "\n" for e in self._entries)
        store.write("entries.jsonl", lines.encode("utf-8"))
        manifest = {
            "format_version": FORMAT_VERSION,
            "num_entries": len(self._entries),
            "num_offered": self.num_offered,
            "dim": int(self.embedder.dim),
            "embedder": self.embedder.spec(),
            "config": dataclasses.asdict(self.config),
        }
        # Written last: a directory without a manifest is an incomplete save.
        store.write("manifest.json", json.dumps(manifest, indent=2).encode("utf-8"))

    @classmethod
    def load(cls, path: str, embedder: Embedder | None = None) -> ExperienceBank:
        """Read a bank written by :meth:`save`; it comes back frozen.

        ``embedder`` must match the one the bank was built with (same name, dim and
        settings); ``None`` rebuilds a built-in embedder from the manifest.
        """
        store = _Store(path)
        try:
            manifest = json.loads(store.read("manifest.json"))
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{store.url} holds no experience bank (no manifest.json; "
                                    "an interrupted save leaves none).") from e
        if manifest.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"bank format_version {manifest.get('format_version')} is not "
                             f"supported (this code reads {FORMAT_VERSION}).")
        saved = manifest["embedder"]
        if embedder is None:
            embedder = build_embedder(saved)
        if int(embedder.dim) != int(manifest["dim"]):
            raise ValueError(
                f"The bank at {store.url} was built with {saved['name']!r} of dim "
                f"{manifest['dim']}, but the embedder given has dim {embedder.dim}. Load it "
                "with the same embedder, or rebuild the bank with the new one.")
        ignore = {"query_instruction"}  # affects queries only, not the stored vectors
        mine = {k: v for k, v in embedder.spec().items() if k not in ignore}
        theirs = {k: v for k, v in saved.items() if k not in ignore}
        if mine != theirs:
            diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
            raise ValueError(
                f"The bank at {store.url} was built with embedder {theirs}, but the given "
                f"embedder is {mine} (differs in {diff}); its vectors would not be comparable. "
                "Use the same embedder settings, or rebuild the bank.")
        index = faiss.deserialize_index(np.frombuffer(store.read("index.faiss"), np.uint8))
        lines = store.read("entries.jsonl").decode("utf-8").splitlines()
        entries = [Experience.from_json(line) for line in lines if line.strip()]
        if index.ntotal != len(entries) or len(entries) != manifest["num_entries"]:
            raise ValueError(f"Corrupt bank at {store.url}: index has {index.ntotal} vectors, "
                             f"entries.jsonl {len(entries)}, manifest {manifest['num_entries']}.")
        if index.d != embedder.dim:
            raise ValueError(f"Corrupt bank at {store.url}: index dim {index.d} != manifest "
                             f"dim {manifest['dim']}.")
        bank = cls(embedder, BankConfig(**manifest["config"]))
        bank._entries = entries
        bank._index = index
        bank.num_offered = int(manifest.get("num_offered", len(entries)))
        return bank
