"""Context (sequence) parallelism: ContextParallelAttention, ring attention over torch.distributed.

Each of P ranks holds a contiguous slice of the sequence. It projects its slice (one GEMM each for
q, k, v, in the ring's (N, L/P, H, D) layout), then its queries attend to every rank's keys and values: the K/V blocks
(and their padding mask) pass around the ring with asynchronous point-to-point sends
(batch_isend_irecv), the next block in flight while the current one is attended, and the blocks'
partial outputs merge by their log-sum-exp. Backward runs the ring again: each block's gradient
with the global output and log-sum-exp, the block's dK/dV accumulators travelling with it and
returning to their owner at the end. Per-rank memory is O(L/P): forward holds q, k, v, the output
accumulator (merged in place), the K/V block in flight and one block's output; without gradients the
local K/V buffers take the next block once sent, so at most two K/V blocks exist. Backward saves
q, the local k and v, the output and the log-sum-exp.

Causal attention is balanced: the sequence is cut in 2P chunks and rank j attends for chunks j and
2P-1-j (one early, one late), so every ring step costs each rank the same half block; the caller's
contiguous slices (chunks 2r, 2r+1 on rank r) are traded in before and back after.
"""

import math
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn


Pair = Tuple[slice, slice, str]  # query rows, key rows, "full" or "diagonal" (causal inside)


# --- The device-specific part: one block's attention with its log-sum-exp, and its backward. ----
# CPU: ATen's flash kernel, which returns the log-sum-exp and takes it back in backward (float64
# too). On CUDA, _scaled_dot_product_efficient_attention returns one as well and would plug in here.

def _block_forward(
    q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], causal: bool, scale: float
) -> Tuple[Tensor, Tensor]:
    """bias: the keys' additive padding (N, 1, 1, S) or None; causal: the kernel's own causal mask
    (never materialised: a block's (L/2P)^2 mask would break per-rank memory O(L/P))."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
    if bias is not None:  # the kernel reports lse 0 for a row with every key masked; merging needs -inf
        masked = torch.isneginf(bias[..., 0, :])  # (N, 1, S)
        dead = masked.cumprod(-1).bool() if causal else masked.all(-1, keepdim=True)  # row i: keys <= i, or all
        lse = lse.masked_fill(dead.expand(lse.shape), float("-inf"))
    return out, lse


def _block_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, bias: Optional[Tensor], causal: bool,
    scale: float,
) -> Tuple[Tensor, Tensor, Tensor]:
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale
    )


# --- Ring plumbing ---------------------------------------------------------------------------------

def _exchange(group: Optional[dist.ProcessGroup], sends: Sequence[Tuple[Tensor, int, int]],
              recvs: Sequence[Tuple[Tensor, int, int]]) -> List[Any]:
    """Starts sends (tensor, group rank, tag) and receives (buffer, group rank, tag); returns the
    requests to wait on."""
    ops_ = [dist.P2POp(dist.isend, t.contiguous(), dist.get_global_rank(group, peer) if group else peer, group, tag)
            for t, peer, tag in sends]
    ops_ += [dist.P2POp(dist.irecv, t, dist.get_global_rank(group, peer) if group else peer, group, tag)
             for t, peer, tag in recvs]
    return dist.batch_isend_irecv(ops_) if ops_ else []


def _pass_on(group: Optional[dist.ProcessGroup], tensors: Sequence[Tensor], rank: int, size: int,
             into: Optional[List[Tensor]] = None, first_tag: int = 0) -> Tuple[List[Tensor], List[Any]]:
    """Sends tensors to the next rank and receives the previous rank's (asynchronously), into the
    buffers ``into`` when given (a block already sent and used: the ring reuses two sets). Tags
    first_tag, first_tag + 1, ...: two exchanges in flight between the same ranks (a block and
    its gradients) must not share a tag, or one may be received into the other's buffer."""
    received = into if into is not None else [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    requests = _exchange(
        group, [(t, (rank + 1) % size, first_tag + i) for i, t in enumerate(tensors)],
        [(t, (rank - 1) % size, first_tag + i) for i, t in enumerate(received)],
    )
    return received, requests


def _wait(requests: List[Any]) -> None:
    for request in requests:
        request.wait()


def _pairs(rank: int, source: int, size: int, length: int, causal: bool) -> List[Pair]:
    """The (query rows, key rows, kind) blocks rank computes against source's keys."""
    whole = slice(0, length)
    if not causal:
        return [(whole, whole, "full")]
    half = length // 2
    halves = (slice(0, half), slice(half, length))
    q_chunks = (rank, 2 * size - 1 - rank)  # global chunk numbers of the two halves
    k_chunks = (source, 2 * size - 1 - source)
    pairs: List[Pair] = []
    for a, qa in enumerate(q_chunks):
        for b, kb in enumerate(k_chunks):
            if qa > kb:
                pairs.append((halves[a], halves[b], "full"))
            elif qa == kb:
                pairs.append((halves[a], halves[b], "diagonal"))
    return pairs


def _bias(padding: Optional[Tensor], keys: slice) -> Optional[Tensor]:
    """The additive mask of one block: the keys' padding, (N, 1, 1, S)."""
    return None if padding is None else padding[:, keys][:, None, None, :]


def _t(x: Tensor) -> Tensor:
    """(N, L, H, D) <-> (N, H, L, D), a view: the ring holds blocks as (N, L, H, D), contiguous,
    which is what the projections write and out_proj reads; the kernels take the transposed view."""
    return x.transpose(1, 2)


def _merge_(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """Adds a block's softmax-normalised partial result (over other keys) into out and lse (views
    of the accumulators), in place, by their log-sum-exp; block_out is scaled in place too, so the
    only temporaries are per-row factors (no copy of the whole local output per block)."""
    new = torch.logaddexp(lse, block_lse)
    safe = torch.where(torch.isneginf(new), torch.zeros_like(new), new)  # no keys yet: 0, not NaN
    out.mul_(torch.exp(lse - safe)[..., None].to(out.dtype))
    out.add_(block_out.mul_(torch.exp(block_lse - safe)[..., None].to(out.dtype)))
    lse.copy_(new)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, padding: Optional[Tensor], causal: bool,
                group: Optional[dist.ProcessGroup], scale: float) -> Tensor:
        """q, k, v: (N, L/P, H, D), contiguous; returns (N, L/P, H, D)."""
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        length = q.size(1)
        out = torch.zeros_like(q)
        lse = torch.full((q.size(0), q.size(2), length), float("-inf"),
                         dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
        block = [k, v] + ([padding] if padding is not None else [])
        spare: Optional[List[Tensor]] = None
        # Memory: the block attended and the one in flight, and for backward the local k, v. Without
        # gradients the local k, v (ours: made by the projections) take the next block once sent.
        reuse_local = not any(ctx.needs_input_grad[:3])
        for step in range(size):
            requests: List[Any] = []
            if step < size - 1:  # the next block travels while this one is attended
                incoming, requests = _pass_on(group, block, rank, size, into=spare)
            source = (rank - step) % size
            for rows, keys, kind in _pairs(rank, source, size, length, causal):
                bias = _bias(block[2] if padding is not None else None, keys)
                o, l = _block_forward(_t(q)[:, :, rows], _t(block[0])[:, :, keys], _t(block[1])[:, :, keys], bias,
                                      kind == "diagonal", scale)
                _merge_(_t(out)[:, :, rows], lse[:, :, rows], o, l)
                del o, l
            _wait(requests)
            if step < size - 1:
                if step > 0:  # sent and attended: the next receive's buffers
                    spare = block
                elif reuse_local:  # not the padding, which may be the caller's own tensor
                    spare = [k, v] + ([torch.empty_like(padding)] if padding is not None else [])
                block = incoming
        del block, spare
        ctx.save_for_backward(q, k, v, padding, out, lse)
        ctx.causal, ctx.group, ctx.scale = causal, group, scale
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> Tuple[Optional[Tensor], ...]:
        q, k, v, padding, out, lse = ctx.saved_tensors
        group, causal, scale = ctx.group, ctx.causal, ctx.scale
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        length = q.size(1)
        dout = dout.contiguous()
        dq = torch.zeros_like(q)
        block = [k, v] + ([padding] if padding is not None else [])
        grads = [torch.zeros_like(k), torch.zeros_like(v)]  # dK, dV of the block held, travelling with it
        spare: Optional[List[Tensor]] = None
        spare_grads: Optional[List[Tensor]] = None
        for step in range(size):
            requests: List[Any] = []
            if step < size - 1:
                incoming, requests = _pass_on(group, block, rank, size, into=spare)
            source = (rank - step) % size
            for rows, keys, kind in _pairs(rank, source, size, length, causal):
                bias = _bias(block[2] if padding is not None else None, keys)
                dq_b, dk_b, dv_b = _block_backward(
                    _t(dout)[:, :, rows], _t(q)[:, :, rows], _t(block[0])[:, :, keys], _t(block[1])[:, :, keys],
                    _t(out)[:, :, rows], lse[:, :, rows].contiguous(), bias, kind == "diagonal", scale,
                )
                _t(dq)[:, :, rows] += dq_b
                _t(grads[0])[:, :, keys] += dk_b
                _t(grads[1])[:, :, keys] += dv_b
                del dq_b, dk_b, dv_b
            # The accumulators follow their block to the next rank; after the last step that is the
            # block's owner, with every rank's contribution.
            received, grad_requests = _pass_on(group, grads, rank, size, into=spare_grads, first_tag=len(block))
            _wait(requests + grad_requests)
            spare_grads, grads = grads, received
            if step < size - 1:
                spare = block if step > 0 else None
                block = incoming
        return dq, grads[0], grads[1], None, None, None, None


class _TradeChunks(torch.autograd.Function):
    """Contiguous slices (chunks 2r, 2r+1 on rank r) to the balanced causal layout (chunks r and
    2P-1-r on rank r) along dim 1, or back (inverse=True); backward trades the gradient back."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Optional[dist.ProcessGroup], inverse: bool) -> Tensor:
        ctx.group, ctx.inverse = group, inverse
        return _trade(x, group, inverse)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, None, None]:
        return _trade(grad, ctx.group, not ctx.inverse), None, None


def _trade(x: Tensor, group: Optional[dist.ProcessGroup], inverse: bool) -> Tensor:
    size, rank = dist.get_world_size(group), dist.get_rank(group)

    def balanced(chunk: int) -> Tuple[int, int]:  # (rank, half) of a chunk in the balanced layout
        return (chunk, 0) if chunk < size else (2 * size - 1 - chunk, 1)

    def contiguous(chunk: int) -> Tuple[int, int]:
        return chunk // 2, chunk % 2

    here, there = (balanced, contiguous) if inverse else (contiguous, balanced)
    mine = [c for c in range(2 * size) if here(c)[0] == rank]
    wanted = [c for c in range(2 * size) if there(c)[0] == rank]
    halves = x.chunk(2, dim=1)
    result = [torch.empty_like(halves[0], memory_format=torch.contiguous_format) for _ in range(2)]
    sends, recvs = [], []
    for c in mine:
        destination, slot = there(c)
        if destination == rank:
            result[slot] = halves[here(c)[1]]
        else:
            sends.append((halves[here(c)[1]], destination, c))
    for c in wanted:
        source, slot = here(c)
        if source != rank:
            recvs.append((result[there(c)[1]], source, c))
    _wait(_exchange(group, sends, recvs))
    return torch.cat(result, dim=1)


class ContextParallelAttention(nn.Module):
    """Self-attention of ``mha`` (a ``torch.nn.MultiheadAttention``, torch's or torchmha's, whose
    parameters it uses) over a sequence split across the ranks of ``group`` (None: the default group).

    ``forward(x_local, key_padding_mask=None, is_causal=False)``: every rank passes its own
    contiguous slice (N, L/P, E) of the sequence, rank r positions [r L/P, (r+1) L/P), batch first
    whatever ``mha.batch_first`` says, every rank the same L/P; and gets the same slice of
    ``mha(x, x, x, need_weights=False, ...)[0]`` over the whole sequence (batch first).
    ``key_padding_mask`` is local too: (N, L/P), this rank's keys (bool True = masked out, or float
    added). ``is_causal``: causal attention (the work is balanced across ranks inside; L/P must be
    even). Parameter gradients are this rank's part: sum them over the group (an all-reduce, or DDP
    / FSDP over the same ranks) for the gradient of the whole sequence's loss.

    Not supported: bias_k/bias_v, add_zero_attn, kdim/vdim != embed_dim, attention dropout in training.
    """

    def __init__(self, mha: nn.MultiheadAttention, group: Optional[dist.ProcessGroup] = None) -> None:
        super().__init__()
        if not isinstance(mha, nn.MultiheadAttention):
            raise TypeError(f"mha must be a torch.nn.MultiheadAttention, not {type(mha).__qualname__}")
        unsupported = [name for name, bad in (
            ("bias_k/bias_v", mha.bias_k is not None), ("add_zero_attn", mha.add_zero_attn),
            ("kdim/vdim != embed_dim", not mha._qkv_same_embed_dim),
        ) if bad]
        if unsupported:
            raise NotImplementedError(f"ContextParallelAttention does not support {', '.join(unsupported)}")
        self.mha = mha
        self.group = group

    def forward(self, x_local: Tensor, key_padding_mask: Optional[Tensor] = None, is_causal: bool = False) -> Tensor:
        mha, group = self.mha, self.group
        if mha.training and mha.dropout > 0:
            raise NotImplementedError("ContextParallelAttention: attention dropout in training is not supported")
        if x_local.dim() != 3 or x_local.size(2) != mha.embed_dim:
            raise ValueError(
                f"x_local must have shape (N, L/P, E={mha.embed_dim}) (batch first), but got {tuple(x_local.shape)}"
            )
        batch, length = x_local.size(0), x_local.size(1)
        lengths = [torch.zeros(2, dtype=torch.long) for _ in range(dist.get_world_size(group))]
        dist.all_gather(lengths, torch.tensor([batch, length]), group=group)
        if any(int(n[0]) != batch or int(n[1]) != length for n in lengths):
            raise ValueError(
                "x_local must have the same batch size and slice length L/P on every rank, but got (N, L/P) = "
                f"{[tuple(n.tolist()) for n in lengths]} by rank"
            )
        if is_causal and length % 2:
            raise ValueError(
                f"with is_causal, x_local's slice length L/P must be even (the ranks trade halves of "
                f"their slices to balance causal work), but got x_local of shape {tuple(x_local.shape)}"
            )
        padding = None
        if key_padding_mask is not None:
            if key_padding_mask.shape != (batch, length):
                raise ValueError(
                    f"key_padding_mask must be this rank's (N, L/P) = ({batch}, {length}), but got "
                    f"{tuple(key_padding_mask.shape)}"
                )
            padding = (
                torch.zeros_like(key_padding_mask, dtype=x_local.dtype).masked_fill(key_padding_mask, float("-inf"))
                if key_padding_mask.dtype == torch.bool else key_padding_mask.to(x_local.dtype)
            ).contiguous()
        if is_causal:
            x_local = _TradeChunks.apply(x_local, group, False)
            if padding is not None:
                padding = _trade(padding, group, False)
        heads, head_dim = mha.num_heads, mha.embed_dim // mha.num_heads
        bias = mha.in_proj_bias
        b_q, b_k, b_v = bias.chunk(3) if bias is not None else (None, None, None)

        # One GEMM each for q, k and v: each comes out (N, L/P, E) = (N, L/P, H, D) contiguous, the
        # ring's layout, with no copy (a packed projection's chunks would need one for K/V to travel).
        qkv = [F.linear(x_local, w, b).unflatten(-1, (heads, head_dim))
               for w, b in zip(mha.in_proj_weight.chunk(3), (b_q, b_k, b_v))]
        del x_local  # causal: the traded copy, not needed past here (autograd keeps what it saved)
        out = _RingAttention.apply(*qkv, padding, is_causal, group, 1.0 / math.sqrt(head_dim))
        del qkv
        out = F.linear(out.flatten(2), mha.out_proj.weight, mha.out_proj.bias)
        if is_causal:
            out = _TradeChunks.apply(out, group, True)
        return out
