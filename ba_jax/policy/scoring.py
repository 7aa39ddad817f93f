"""Per-token log-probabilities and entropies of responses under a policy.

The trainer scores the same sampled tokens three times (policy, old policy,
reference); the sampler's `logprobs` are the same numbers, so they can stand in
for the old policy's. The LM head runs chunk by chunk along the sequence, so no
`[rows, length, vocab]` logits are ever held, forward or backward.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ba_jax.policy import attention as attention_lib
from ba_jax.policy.model import token_einsum


def left_justify(ids_BxL: jax.Array, mask_BxL: jax.Array, pad_id: int = 0):
  """Moves every row's real tokens to the right end, keeping their order.

  Rows may arrive left-padded, right-padded or with holes; afterwards each row
  is left-padded (`[pad .. pad, t0 .. tk]`), so the last column holds the last
  real token of every non-empty row. Returns `(ids_BxL, mask_BxL)`, mask int32.
  """
  mask_BxL = (mask_BxL != 0).astype(jnp.int32)
  # A stable sort on the mask puts the padding first, the tokens after, in order.
  order_BxL = jnp.argsort(mask_BxL, axis=-1, stable=True)
  ids_BxL = jnp.take_along_axis(ids_BxL, order_BxL, axis=-1)
  mask_BxL = jnp.take_along_axis(mask_BxL, order_BxL, axis=-1)
  return jnp.where(mask_BxL == 1, ids_BxL, pad_id).astype(jnp.int32), mask_BxL


def token_logprobs(logits_NxTxV: jax.Array, tokens_NxT: jax.Array,
                   temperature: float = 1.0):
  """Log-prob of each token and the entropy of its distribution, in float32."""
  logp_NxTxV = jax.nn.log_softmax(logits_NxTxV.astype(jnp.float32) / temperature)
  logp_NxT = jnp.take_along_axis(logp_NxTxV, tokens_NxT[..., None], axis=-1)[..., 0]
  entropy_NxT = -jnp.sum(jnp.exp(logp_NxTxV) * logp_NxTxV, axis=-1)
  return logp_NxT, entropy_NxT


def chunked_token_logprobs(hidden_NxTxE: jax.Array, head: jax.Array,
                           tokens_NxT: jax.Array, temperature: float = 1.0,
                           chunk: int = 512, head_axes: str = "ev"):
  """`token_logprobs` of `hidden @ head`, `chunk` positions at a time.

  `head` is [E, V] (`head_axes="ev"`) or [V, E] (`"ve"`, a tied embedding as
  stored; `Decoder.head_operand`). A `lax.scan` over chunks of the sequence,
  each under `jax.checkpoint` when there are several: only one `[N, chunk, V]`
  block of logits is live in the forward pass, and the backward pass
  recomputes each block from the hidden states it saved. With one chunk
  nothing runs between its forward and its backward, so recomputing it would
  save no memory and is skipped.

  A token's logit is also taken as its hidden state times its own head row
  (the same sum as that entry of the logits, in another order): the backward
  pass then scatters into those rows instead of building a one-hot
  `[N, chunk, V]` gradient of a gather from the block.
  """
  if head_axes not in ("ev", "ve"):
    raise ValueError(f"chunked_token_logprobs: head_axes={head_axes!r}; expected 'ev' ([E, V]) "
                     "or 've' ([V, E])")
  N, T, _ = hidden_NxTxE.shape
  C = min(chunk, T)
  n = -(-T // C)

  def chunks(x):  # [N, T, ...] -> [n, N, C, ...]; the padded tail is dropped below
    x = jnp.pad(x, [(0, 0), (0, n * C - T)] + [(0, 0)] * (x.ndim - 2))
    return jnp.moveaxis(x.reshape(N, n, C, *x.shape[2:]), 1, 0)

  def one_chunk(hidden_NxCxE, tokens_NxC):
    f32 = jnp.float32
    logits_NxCxV = token_einsum(f"te,{head_axes}->tv", hidden_NxCxE, head,
                                einsum=attention_lib.einsum_f32)
    z_NxCxV = logits_NxCxV.astype(f32) / temperature
    # log-sum-exp and entropy from one exp of the shifted logits: with
    # e = exp(z - max), s = sum(e), lse = max + log(s) and the entropy
    # -sum(p log p) = log(s) - sum(e (z - max)) / s. (The max carries no
    # gradient: neither value depends on it.)
    max_NxC = jax.lax.stop_gradient(jnp.max(z_NxCxV, axis=-1))
    zm_NxCxV = z_NxCxV - max_NxC[..., None]
    e_NxCxV = jnp.exp(zm_NxCxV)
    s_NxC = jnp.sum(e_NxCxV, axis=-1)
    log_s_NxC = jnp.log(s_NxC)
    lse_NxC = max_NxC + log_s_NxC
    entropy_NxC = log_s_NxC - jnp.sum(e_NxCxV * zm_NxCxV, axis=-1) / s_NxC
    rows_NxCxE = head[tokens_NxC] if head_axes == "ve" else jnp.moveaxis(
        jnp.take(head, tokens_NxC, axis=1), 0, -1)
    # Products of 16-bit numbers are exact in float32: the same sum the matmul accumulates.
    z_tok_NxC = jnp.sum(hidden_NxCxE.astype(f32) * rows_NxCxE.astype(f32), axis=-1) / temperature
    return z_tok_NxC - lse_NxC, entropy_NxC

  if n > 1:
    one_chunk = jax.checkpoint(one_chunk)

  _, (logp_nxNxC, entropy_nxNxC) = jax.lax.scan(
      lambda _, xs: (None, one_chunk(*xs)), None,
      (chunks(hidden_NxTxE), chunks(tokens_NxT)))
  unchunk = lambda x: jnp.moveaxis(x, 0, 1).reshape(N, n * C)[:, :T]
  return unchunk(logp_nxNxC), unchunk(entropy_nxNxC)


def _grouped_hidden(model, prompt_ids_BxP, prompt_mask_BxP, response_ids_NxT,
                    response_mask_NxT):
  """The hidden states [N, T, E] that predict each response token, from one
  packed row `[prompt; response_1; ..; response_G]` per group (B prompts,
  left-justified; N = B x G responses, group-major)."""
  B, P = prompt_ids_BxP.shape
  N, T = response_ids_NxT.shape
  G = N // B
  ids_BxL = jnp.concatenate([prompt_ids_BxP, response_ids_NxT.reshape(B, G * T)], axis=1)
  mask_BxL = jnp.concatenate([prompt_mask_BxP, response_mask_NxT.reshape(B, G * T)], axis=1)
  hidden_BxLxE, _ = model.hidden_states(ids_BxL, mask_BxL, shared_prefix=(P, G))
  E = hidden_BxLxE.shape[-1]
  # Token 0 of every response is predicted by the prompt's last position, token
  # t > 0 by its own response's position t - 1.
  last_BxGx1xE = jnp.broadcast_to(hidden_BxLxE[:, None, P - 1:P], (B, G, 1, E))
  own_BxGxTxE = hidden_BxLxE[:, P:].reshape(B, G, T, E)
  return jnp.concatenate([last_BxGx1xE, own_BxGxTxE[:, :, :T - 1]], axis=2).reshape(N, T, E)


def score_responses(model, prompt_ids_NxP, prompt_mask_NxP, response_ids_NxT,
                    response_mask_NxT, *, temperature: float = 1.0,
                    chunk: int | None = None, prompt_group: int = 1):
  """Scores responses with one forward pass over `[prompt; response]`.

  Args:
    model: a `Decoder` (`model.hidden_states` and `model.head_operand`).
    prompt_ids_NxP, prompt_mask_NxP: prompts, any padding (left is usual).
    response_ids_NxT, response_mask_NxT: responses starting at column 0, with
      mask 1 on real tokens (the stop token included) and 0 after.
    temperature: the sampling temperature; must be > 0. Greedy samples (drawn
      at temperature 0) carry log-probs at temperature 1.0, so score them so.
    chunk: response positions per LM-head chunk; default
      `model.config.logprob_chunk` (config key `model.logprob_chunk`).
    prompt_group: G > 1 when the rows come in consecutive groups of G that
      share one prompt (a GRPO batch, group-major): the first row's prompt
      stands for its group and the forward pass computes it once per group,
      packed with the group's G responses (`Decoder.hidden_states`'s
      `shared_prefix`). The same values as G = 1 up to float rounding, with
      the prompt's share of the work divided by G. N must be a multiple of G.

  Returns:
    `(logp_NxT, entropy_NxT)`, float32: the log-probability of each response
    token under `softmax(logits / temperature)` and that distribution's
    entropy, zero where the response mask is 0. Pure, jittable and
    differentiable in the model's parameters.
  """
  if not isinstance(temperature, (int, float)) or temperature <= 0:
    raise ValueError(
        f"score_responses: temperature must be a number > 0, got {temperature!r}"
        " (greedy samples are scored at temperature=1.0)")
  if prompt_ids_NxP.shape != prompt_mask_NxP.shape:
    raise ValueError(f"score_responses: prompt_ids shape {prompt_ids_NxP.shape}"
                     f" != prompt_mask shape {prompt_mask_NxP.shape}")
  if response_ids_NxT.shape != response_mask_NxT.shape:
    raise ValueError(
        f"score_responses: response_ids shape {response_ids_NxT.shape}"
        f" != response_mask shape {response_mask_NxT.shape}")
  if prompt_ids_NxP.ndim != 2 or response_ids_NxT.ndim != 2 or (
      prompt_ids_NxP.shape[0] != response_ids_NxT.shape[0]):
    raise ValueError(
        "score_responses: expected prompts [N, P] and responses [N, T] with the"
        f" same N, got {prompt_ids_NxP.shape} and {response_ids_NxT.shape}")
  P = prompt_ids_NxP.shape[1]
  T = response_ids_NxT.shape[1]
  if not isinstance(prompt_group, int) or prompt_group < 1 or prompt_ids_NxP.shape[0] % prompt_group:
    raise ValueError(f"score_responses: prompt_group={prompt_group!r} must be a positive int dividing the "
                     f"{prompt_ids_NxP.shape[0]} rows (consecutive rows of a group share a prompt)")
  chunk = model.config.logprob_chunk if chunk is None else chunk
  if not isinstance(chunk, int) or chunk < 1:
    raise ValueError(f"score_responses: chunk must be a positive int (tokens per LM-head chunk), got {chunk!r}")
  response_mask_NxT = (response_mask_NxT != 0).astype(jnp.int32)
  response_ids_NxT = response_ids_NxT.astype(jnp.int32)
  # The first row of each group stands for its prompt (every row when G = 1).
  prompt_ids, prompt_mask = left_justify(prompt_ids_NxP[::prompt_group],
                                         prompt_mask_NxP[::prompt_group])
  # The hidden state at column P-1+t of [prompt; response] predicts response token t.
  if prompt_group == 1:
    hidden_NxLxE, _ = model.hidden_states(jnp.concatenate([prompt_ids, response_ids_NxT], axis=1),
                                          jnp.concatenate([prompt_mask, response_mask_NxT], axis=1))
    hidden_NxTxE = hidden_NxLxE[:, P - 1:P - 1 + T]
  else:
    hidden_NxTxE = _grouped_hidden(model, prompt_ids, prompt_mask, response_ids_NxT, response_mask_NxT)
  head, head_axes = model.head_operand()
  logp_NxT, entropy_NxT = chunked_token_logprobs(
      hidden_NxTxE, head, response_ids_NxT, temperature, chunk, head_axes)
  keep_NxT = response_mask_NxT == 1
  return (jnp.where(keep_NxT, logp_NxT, 0.0),
          jnp.where(keep_NxT, entropy_NxT, 0.0))
