"""The jitted step of the text-context self-distillation arms (OPSD, SDPO, SDFT, Skill-SD).

The same student objective as LOPD -- the global token mean of the top-M + tail reverse
KL from the student to a teacher on the student's own sampled tokens -- with the teacher
conditioned on text tokens at the latent slot (:mod:`lopd_jax.method.text_context`) instead of
latents, and no composer, margin or anchor. The teacher is theta0 (OPSD, SDPO, Skill-SD)
or an EMA of the student (SDFT, ``state["ema"]``), always stop-gradient.

Batch keys: tokens, attention_mask, loss_mask [B, S], insert_at [B], ctx_ids [B, C],
ctx_len [B], row_weight [B] (0 leaves a row out of the distillation, e.g. an SDPO group
without a success), rewards [B], old_logp [B, S] (the sampler's log-probs, read with
``steps.is_correction``).

Metrics: ``distill_kl``, ``delta`` (the privilege margin of docs/method.md with A = 2r - 1,
for Figure 4's Delta panel; nothing is trained on it), ``teacher_student_logp_gap``,
``supervised_rollouts``, ``delta_per_rollout`` [B] (Skill-SD's UCB1 reward), student
gradient norm, ``mean_reward``, ``tokens``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from lopd_jax.method import importance, losses
from lopd_jax.method.packing import is_packed, packed_teacher_hidden
from lopd_jax.method.text_context import align_teacher_hidden, text_teacher_inputs
from train.steps import per_trajectory
from train.system import LOPDSystem

sg = jax.lax.stop_gradient


def teacher_modules(system: LOPDSystem, state, frozen, use_ema: bool):
    """``(teacher module, lora_on)``: theta0, or the EMA of the student (full params over
    theta0's architecture, or theta0 plus the EMA of a LoRA student)."""
    lora0 = state["composer0"]["lora"]
    if not use_ema:
        return system.backbone(sg(frozen), sg(lora0)), False
    if system.step_cfg.student_mode == "full":
        return system.backbone(sg(state["ema"]), sg(lora0)), False
    return system.backbone(sg(frozen), sg(state["ema"])), True


def text_distill_loss(system: LOPDSystem, student_p, state, frozen, batch, use_ema: bool, total_tokens=None,
                      total_rollouts=None):
    """(loss, metrics) of one batch (see the module docstring).

    ``total_tokens`` / ``total_rollouts``: the whole batch's distilled tokens (supervised
    tokens of rows with ``row_weight`` != 0) and rollouts with such tokens when ``batch`` is
    a length-bucketed pass of it (:class:`train.bucketed_steps.BucketedTextStep`): loss
    and mean metrics are then that pass's share. With ``steps.is_correction`` each
    rollout's KL is weighted against the batch's ``old_logp`` as in the LOPD loss
    (:func:`lopd_jax.method.importance.weighted_kl`); Delta stays unweighted."""
    cfg = system.step_cfg
    tokens, amask = batch["tokens"], batch["attention_mask"].astype(bool)
    teacher, lora_on = teacher_modules(system, state, frozen, use_ema)
    if is_packed(batch):  # each segment's context block sits in the host-built teacher rows
        t_hidden = sg(packed_teacher_hidden(teacher, batch, lora=lora_on))
    else:
        t_ids, t_mask = text_teacher_inputs(tokens, amask, batch["insert_at"], batch["ctx_ids"], batch["ctx_len"])
        t_full = teacher(t_ids, attention_mask=t_mask, lora=lora_on, return_hidden=True)
        t_hidden = sg(align_teacher_hidden(t_full, batch["insert_at"], batch["ctx_len"], tokens.shape[1]))
    student, use_lora = system.student(student_p, sg(frozen), sg(state["composer"]["lora"]))
    s_hidden = student(tokens, attention_mask=amask, segment_ids=batch.get("segment_ids"), lora=use_lora,
                       return_hidden=True)
    stats = losses.chunked_distill_stats(
        s_hidden[:, :-1], student.lm_head_kernel(), t_hidden[:, :-1], sg(teacher.lm_head_kernel()), tokens[:, 1:],
        top_m=cfg.loss.top_m, chunk_size=cfg.loss.logits_chunk, compute_dtype=system.model_cfg.jnp_dtype)
    view, rows = per_trajectory(batch)
    stats = {k: view(v) for k, v in stats.items()}
    mask = view(batch["loss_mask"][:, 1:].astype(jnp.float32)) * rows(batch["row_weight"])[:, None].astype(jnp.float32)
    n_all = total_tokens  # None: this batch's own count
    old_logp = view(batch["old_logp"][:, 1:]) if "old_logp" in batch and cfg.loss.is_correction != "none" else None
    kl, is_metrics = importance.weighted_kl(stats["kl"], stats["student_logp"], old_logp, mask, cfg.loss, n_all,
                                            total_rollouts)
    distill = losses.masked_token_mean(kl, mask, n_all)
    adv = losses.advantages_from_rewards(rows(batch["rewards"]).astype(jnp.float32))
    delta, delta_i, n = losses.privilege_delta(sg(stats["teacher_logp"]), stats["student_logp"], mask, adv, n_all)
    gap = losses.masked_token_mean(sg(stats["teacher_logp"] - stats["student_logp"]), mask, n_all)
    return distill, {"loss": sg(distill), "distill_kl": sg(distill), "delta": sg(delta),
                     "teacher_student_logp_gap": gap, "supervised_tokens": jnp.sum(n),
                     "supervised_rollouts": jnp.sum((n > 0).astype(jnp.float32)), "delta_per_rollout": sg(delta_i),
                     **is_metrics}


def text_state_shardings(system: LOPDSystem, state):
    """Shardings of a text-arm state: the LOPD state's, plus ``ema`` like the student."""
    sh = system.state_shardings(state)
    if sh is not None and "ema" in state:
        sh = {**sh, "ema": sh["student"]}
    return sh


def text_update(system: LOPDSystem, state, grads, metrics, ema_decay: float | None, mean_reward, tokens):
    """The end of a text-distillation step from the whole batch's student gradients and
    metrics: one AdamW step, then (``ema_decay``) the EMA teacher's update. Returns
    ``(state, metrics)``."""
    updates, opt_state = system.student_opt.update(grads, state["student_opt"], state["student"])
    new = dict(state)
    new["student"], new["student_opt"] = optax.apply_updates(state["student"], updates), opt_state
    if ema_decay is not None:
        new["ema"] = jax.tree.map(lambda e, s: (ema_decay * e + (1.0 - ema_decay) * s).astype(e.dtype),
                                  state["ema"], new["student"])
    new["step"] = state["step"] + 1
    metrics["student_grad_norm"] = optax.global_norm(grads)
    metrics["mean_reward"] = mean_reward
    metrics["tokens"] = tokens
    return new, metrics


def make_text_distill_step(system: LOPDSystem, example_state, example_batch, ema_decay: float | None = None):
    """``(state, frozen, batch) -> (state, metrics)``: one AdamW step of the student on the
    text-context distillation loss; with ``ema_decay`` the teacher is ``state["ema"]``,
    updated after the step as ``decay * ema + (1 - decay) * student``."""
    use_ema = ema_decay is not None

    def step(state, frozen, batch):
        (loss, metrics), grads = jax.value_and_grad(
            lambda sp: text_distill_loss(system, sp, state, frozen, batch, use_ema), has_aux=True)(state["student"])
        return text_update(system, state, grads, metrics, ema_decay, jnp.mean(batch["rewards"].astype(jnp.float32)),
                           jnp.sum(batch["attention_mask"].astype(jnp.float32)))

    state_sh = text_state_shardings(system, example_state)
    if system.rules is None:
        return jax.jit(step, donate_argnums=(0,))
    rep = system.rules.replicated()
    return jax.jit(step, in_shardings=(state_sh, system.frozen_shardings(), system.batch_shardings(example_batch)),
                   out_shardings=(state_sh, rep), donate_argnums=(0,))
