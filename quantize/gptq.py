"""GPTQ (Frantar et al. 2022): quantize one linear layer column by column, error-compensated.

Each input column is rounded in turn and its rounding error is spread over the columns not
yet quantized through the inverse Hessian H^-1 of the layer's squared output error,
H = 2/n * sum x x^T over calibration activations x. Updates are applied lazily in blocks of
`block_size` columns (rank-`block_size` update of the rest of the weight per block).

Codes, scales and zero points follow `quantize/rtn.py` (w = (q - zero) * scale, groups of
`group_size` consecutive input columns) and come back in the original column order: the
checkpoint format has no g_idx, so with `act_order` the group parameters are fixed up front
("static groups") from the original weight and only the rounding order changes.
"""

from __future__ import annotations

import logging

import torch

from edgellm.errors import EdgeLLMError, InvalidParameterError
from edgellm.quantize.rtn import QuantConfig, QuantizedWeight, compute_qparams

log = logging.getLogger(__name__)

CHOLESKY_RETRIES = 3  # each retry multiplies the damping by 10


class GPTQError(EdgeLLMError):
    """GPTQ could not run on a layer (its Hessian is not usable even with more damping)."""


class HessianAccumulator:
    """Running H = 2/n * sum x x^T over the activations x fed to one linear layer.

    float32 like the GPTQ reference, and only the blocks on and above the diagonal are
    multiplied (H is symmetric; the lower blocks are mirrored once, when H is read): on a
    8960-wide down_proj that is 58% of the multiply-adds of x^T x, at half the bytes and
    twice the speed of float64."""

    __slots__ = ("in_features", "n_samples", "_h", "_blocks")

    def __init__(self, in_features: int, n_blocks: int = 8):
        self.in_features = in_features
        self.n_samples = 0
        self._h = torch.zeros(in_features, in_features)  # [in, in], upper blocks filled
        bounds = torch.linspace(0, in_features, min(n_blocks, in_features) + 1).long().tolist()
        self._blocks = list(zip(bounds[:-1], bounds[1:], strict=True))

    def add(self, x: torch.Tensor) -> None:
        """Add activations x [..., in_features] (each row one sample)."""
        if x.shape[-1] != self.in_features:
            raise InvalidParameterError(
                f"activations have {x.shape[-1]} features, the layer takes {self.in_features}"
            )
        x = x.detach().reshape(-1, self.in_features).float()  # [m, in]
        m, n = x.shape[0], self.n_samples
        if m == 0:
            return
        # running mean keeps H at the scale of one sample whatever n is
        beta, alpha = n / (n + m), 2 / (n + m)
        for i, (a, b) in enumerate(self._blocks):
            xa = x[:, a:b].T
            for c, d in self._blocks[i:]:
                # in place into the view: no [in, in] temporary
                self._h[a:b, c:d].addmm_(xa, x[:, c:d], beta=beta, alpha=alpha)
        self.n_samples = n + m

    @property
    def hessian(self) -> torch.Tensor:  # float32 [in, in]
        """H, exactly symmetric: the lower blocks are filled from the upper ones in place, and
        each diagonal block's lower triangle from its upper one (a BLAS product X^T X need not
        be bitwise symmetric: on an AMD EPYC it was not, on an Intel Xeon it was)."""
        for i, (a, b) in enumerate(self._blocks):
            blk = self._h[a:b, a:b]
            blk.copy_(torch.triu(blk) + torch.triu(blk, 1).T)
            for c, d in self._blocks[i + 1 :]:
                self._h[c:d, a:b] = self._h[a:b, c:d].T
        return self._h


def output_error(w: torch.Tensor, wq: torch.Tensor, H: torch.Tensor) -> float:
    """tr((W - Q) H (W - Q)^T) / out: with H = 2/n X^T X, 2/(n out) * ||X W^T - X Q^T||^2."""
    d = (w.float() - wq.float()).double()  # [out, in]
    return float(((d @ H.double()) * d).sum() / d.shape[0])


def gptq_quantize(
    w: torch.Tensor,  # [out, in]
    H: torch.Tensor,  # [in, in]
    config: QuantConfig,
    block_size: int = 128,
    damp: float = 0.01,
    act_order: bool = False,
    static_groups: bool | None = None,
) -> QuantizedWeight:
    """GPTQ-quantize w given its input Hessian H; codes and group params in original column order.

    `damp` * mean(diag H) is added to the diagonal (raised 10x per failed Cholesky, up to
    CHOLESKY_RETRIES times, then GPTQError). `act_order` rounds columns by decreasing
    diag(H). `static_groups` (default: same as act_order) fixes every group's scale/zero from
    the original weight up front; otherwise a group's params come from the error-updated
    weight when the loop reaches it. act_order needs static groups (no g_idx in the format).
    Dead inputs (diag H == 0) get a zero weight column.
    """
    out, inp = _check_args(w, H, config, block_size, damp)
    static = act_order if static_groups is None else static_groups
    if act_order and not static:
        raise InvalidParameterError("act_order needs static_groups: the format has no g_idx")
    # [in, in] matrices are the memory here (321 MB each for an 8960-wide down_proj): besides
    # the caller's H (untouched) one: the damped, permuted copy, factored, inverted and
    # factored again in place, dropped before the error is measured
    W, H = w.detach().float().clone(), H.detach().float()  # [out, in], [in, in]
    diag = _drop_dead_inputs(W, H)
    perm = _column_order(diag, act_order)  # [in]: the i-th column quantized
    loop = _ColumnLoop(W, config, perm, static)
    Hinv = _inverse_hessian_factor(H, perm, damp, (out, inp))  # [in, in] upper
    q = loop.run(W[:, perm], Hinv, block_size)  # int8 [out, in], permuted order
    del Hinv, W
    loop.W = loop.Hinv = None
    qw = QuantizedWeight(q[:, torch.argsort(perm)], loop.scale, loop.zero, config)
    qw.error = float((qw.dequantize() - w.float()).pow(2).mean())
    return qw


def _check_args(w, H, config: QuantConfig, block_size: int, damp: float) -> tuple[int, int]:
    if w.dim() != 2:
        raise InvalidParameterError(f"GPTQ takes a 2-D weight [out, in], got shape {list(w.shape)}")
    out, inp = w.shape
    if tuple(H.shape) != (inp, inp):
        raise InvalidParameterError(
            f"Hessian of shape {list(H.shape)} does not match a weight with {inp} inputs"
        )
    if block_size < 1 or damp < 0:
        raise InvalidParameterError(f"need block_size >= 1 and damp >= 0, got {block_size}, {damp}")
    config.groups(inp)  # raises when the group size does not divide the row
    if not _all_finite(H):  # in row blocks: on the whole of H the check costs 1.6 H
        raise GPTQError(f"Hessian of the [{out}, {inp}] layer has NaN/inf entries")
    return out, inp


def _drop_dead_inputs(W: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
    """Inputs that never fire carry no signal: zero their weights. Returns diag(H) with those
    entries 1 (the caller sets them so in its copy of H, which keeps it invertible)."""
    diag = torch.diag(H).clone()  # [in]
    dead = diag == 0
    diag[dead] = 1
    W[:, dead] = 0
    return diag


def _column_order(diag: torch.Tensor, act_order: bool) -> torch.Tensor:  # int64 [in]
    if not act_order:
        return torch.arange(diag.shape[0])
    # stable: equal activations keep their original order (reproducible permutations)
    return torch.argsort(diag, descending=True, stable=True)


def _inverse_hessian_factor(
    H: torch.Tensor, perm: torch.Tensor, damp: float, shape: tuple[int, int]
) -> torch.Tensor:
    """Upper Cholesky factor U of (P H P^T + d I)^-1 (U^T U = the inverse), with the columns
    in quantization order `perm` and dead inputs' diagonal set to 1; retrying with more
    damping.

    One factorization and one triangular inverse (2n^3/3 flops), not the reference's three
    steps (Cholesky, inverse from it, Cholesky of the inverse: 4n^3/3; 7.0 s against 3.8 s
    at 8960 wide on this machine, measured): with J the order reversal, the Cholesky factor
    of J A J is L, so A = (J L J)(J L J)^T with J L J upper, and A^-1 = U^T U for
    U = (J L J)^-1 = J L^-1 J, upper with a positive diagonal: the factor, being unique."""
    mean_diag = float(torch.diag(H).mean())
    info = torch.zeros((), dtype=torch.int32)
    order = perm.flip(0)
    for attempt in range(CHOLESKY_RETRIES + 1):
        Hd = H[order[:, None], order[None, :]]  # the one copy of H: every step is in place
        d = Hd.diagonal()
        d[d == 0] = 1
        d.add_(damp * mean_diag)  # H + d I without an identity matrix
        # LAPACK works in column-major order: on the transposed view of a symmetric matrix
        # torch factors in place, where a row-major one costs a 321 MB temporary per step
        # at down_proj (measured). The upper factor R of the view (R^T R = J A J) is, read
        # row-major, the lower factor L = R^T.
        F = Hd.mT
        torch.linalg.cholesky_ex(F, upper=True, out=(F, info))
        if info == 0 and _all_finite(F):
            _invert_lower_(Hd)
            _flip_(Hd)
            if _all_finite(Hd):
                return Hd.triu_()  # below the diagonal: what the factorization left there
        del Hd, d, F  # nothing [in, in] kept across a retry
        if attempt < CHOLESKY_RETRIES:
            more = damp * 10 if damp > 0 else 0.01
            log.warning("GPTQ %s: Cholesky failed at damping %g, retrying at %g", shape, damp, more)
            damp = more
    raise GPTQError(
        f"Hessian of the [{shape[0]}, {shape[1]}] layer is not positive definite even with "
        f"damping {damp:g} * mean(diag H) ({mean_diag:g}); check the calibration activations"
    )


def _invert_lower_(L: torch.Tensor, block: int = 256) -> torch.Tensor:
    """L [n, n] (lower triangular, row-major; the upper triangle is not read) becomes L^-1
    in place, block column by block column from the last: LAPACK's blocked trtri, with
    temporaries of [n, block]. Column block j of the inverse is -L22^-1 L21 L11^-1, where
    L22^-1 (the blocks after j) is already in place and is applied row block by row block,
    so its upper triangle is never read either (the inverted diagonal blocks' is exactly 0)."""
    n = L.shape[0]
    for j in reversed(range(0, n, block)):
        e = min(j + block, n)
        D = L[j:e, j:e].clone()  # L11, [block, block]
        if e < n:
            X = L[e:, j:e]  # L21
            Y = L.new_empty(n - e, e - j)
            for r in range(e, n, block):  # Y = L22^-1 L21, lower block rows only
                r2 = min(r + block, n)
                torch.matmul(L[r:r2, e:r2], X[: r2 - e], out=Y[r - e : r2 - e])
            L[e:, j:e] = torch.linalg.solve_triangular(D, Y.neg_(), upper=False, left=False)
        L[j:e, j:e] = torch.linalg.solve_triangular(D, torch.eye(e - j, dtype=L.dtype), upper=False)
    return L


def _flip_(m: torch.Tensor, rows: int = 256) -> torch.Tensor:
    """m [n, n] becomes J m J (both orders reversed) in place, `rows` rows at a time."""
    n = m.shape[0]
    half = n // 2
    for a in range(0, half, rows):
        b = min(a + rows, half)
        top = m[a:b].flip(0, 1)  # a copy
        m[a:b] = m[n - b : n - a].flip(0, 1)
        m[n - b : n - a] = top
    if n % 2:
        mid = m[half]
        mid.copy_(mid.flip(0))
    return m


def _all_finite(m: torch.Tensor, rows: int = 512) -> bool:
    """`torch.isfinite(m).all()` a block of rows at a time: on the whole of an [8960, 8960]
    matrix its temporaries peak at 534 MB (measured)."""
    return all(bool(torch.isfinite(b).all()) for b in m.split(rows))


class _ColumnLoop:
    """The GPTQ column loop in quantization order, writing group params in original order."""

    def __init__(self, W: torch.Tensor, config: QuantConfig, perm: torch.Tensor, static: bool):
        out, inp = W.shape
        self.config, self.g, self.static = config, config.group_len(inp), static
        self.group_of = (perm // self.g).tolist()  # group of the i-th quantized column
        n_groups = inp // self.g
        self.scale = torch.zeros(out, n_groups)  # float32 [out, n_groups]
        zero = None if config.symmetric else torch.zeros(out, n_groups, dtype=torch.int8)
        self.zero = zero  # int8 [out, n_groups] | None
        if static:  # from the original weight, exactly as RTN would
            self.scale, self.zero = compute_qparams(W.view(out, n_groups, self.g), config)
        self._params_of = -1  # the group whose parameters `_params` last returned

    def run(self, W: torch.Tensor, Hinv: torch.Tensor, block_size: int) -> torch.Tensor:
        """Quantize W [out, in] (modified in place) in column order; int8 codes [out, in].

        A block's columns are worked on as the rows of a contiguous [block, out] copy: a
        column of W is `out` strided reads, a row of the copy one contiguous one (same
        arithmetic: the codes are bitwise those of the column-wise loop)."""
        self.W, self.Hinv = W, Hinv
        q = torch.empty(W.shape, dtype=torch.int8)  # [out, in]
        for i1 in range(0, W.shape[1], block_size):
            i2 = min(i1 + block_size, W.shape[1])
            self.Wb = W[:, i1:i2].T.contiguous()  # [block, out]: column j is row j - i1
            err = self._block(i1, i2, q)  # [block, out]
            W[:, i2:] -= err.T @ Hinv[i1:i2, i2:]  # lazy update of the columns after the block
        self.Wb = None
        return q

    def _block(self, i1: int, i2: int, q: torch.Tensor) -> torch.Tensor:
        Wb, Hinv, cfg = self.Wb, self.Hinv, self.config
        err = torch.zeros(i2 - i1, Wb.shape[1])  # [block, out]: scaled rounding errors
        codes = torch.empty(i2 - i1, Wb.shape[1])  # [block, out], integers in float32
        for j in range(i1, i2):
            r = j - i1
            scale, zero = self._params(j, i1, i2, err)  # [out], [out] float32 | None
            c = codes[r]
            torch.div(Wb[r], scale, out=c).round_()  # as quantize_values
            if zero is not None:
                c.add_(zero)
            c.clamp_(cfg.qmin, cfg.qmax)
            wq = c if zero is None else c - zero
            e = torch.div(Wb[r] - wq * scale, Hinv[j, j], out=err[r])  # [out]
            Wb[r + 1 :] -= Hinv[j, r + 1 + i1 : i2, None] * e  # OBS update inside the block
        q[:, i1:i2] = codes.T.to(torch.int8)
        return err

    def _params(self, j: int, i1: int, i2: int, err: torch.Tensor):
        """Scale/zero [out] of column j's group; lazy groups are fitted at their first column."""
        k = self.group_of[j]
        if not self.static and j % self.g == 0:
            scale, zero = compute_qparams(self._current(j, j + self.g, i1, i2, err), self.config)
            self.scale[:, k] = scale
            if zero is not None:
                self.zero[:, k] = zero
            self._params_of = -1  # refitted: the copies below are stale
        if self._params_of != k:  # contiguous float32 copies of group k's columns
            self._params_of = k
            self._scale_k = self.scale[:, k].contiguous()
            self._zero_k = None if self.zero is None else self.zero[:, k].float()
        return self._scale_k, self._zero_k

    def _current(self, j: int, end: int, i1: int, i2: int, err: torch.Tensor) -> torch.Tensor:
        """Error-updated W[:, j:end] [out, end - j], including this block's pending updates."""
        mine = self.Wb[j - i1 : end - i1].T  # this block's columns, up to date
        if end <= i2:
            return mine
        pending = err[: j - i1].T @ self.Hinv[i1:j, i2:end]  # [out, end - i2]
        return torch.cat([mine, self.W[:, i2:end] - pending], dim=1)
