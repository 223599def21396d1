"""LyCORIS's LoHa and LoKr (also PEFT's LoHaConfig / LoKrConfig factors), their Tucker forms, and LoCon's Tucker form
(lora_mid): a layer's factors as one exact low-rank pair (A, B), which then goes the LoRA path."""

import math

import mlx.core as mx

from ..errors import MlxdiffError
from .files import _short

# _lycoris turns a layer's LoHa / LoKr factors into one exact low-rank pair (A, B); hada_t1 / hada_t2 / lokr_t2 are
# their Tucker cores (a convolution's kh x kw kernel in an r x r core)
LYCORIS_FACTORS = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b",
                   "lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b",
                   "hada_t1", "hada_t2", "lokr_t2")


def _low_rank(m):
    """(U, V) with U @ V = m, the inner size min(rows, cols): one of them an identity."""
    rows, cols = m.shape
    return (mx.eye(rows), m) if rows <= cols else (m, mx.eye(cols))


def _kron_factors(u1, u2):
    """kron(u1, u2) of two matrices (numpy's / torch's order), as LyCORIS's make_kron builds it."""
    return (u1[:, None, :, None] * u2[None, :, None, :]).reshape(u1.shape[0] * u2.shape[0],
                                                                 u1.shape[1] * u2.shape[1])


def _tucker(core, up, down):
    """(U, V) with U @ V the Tucker weight of a core (i, j, kh, kw), `up` (i, out) and `down` (j, in), flattened as
    PyTorch's (out, in x kh x kw): W[p, q, h, w] = sum_ij core[i, j, h, w] up[i, p] down[j, q] (LyCORIS's
    functional/general.py rebuild_tucker, loha.py HadaWeightTucker, ComfyUI's weight_adapter/lokr.py): U = up^T,
    V[i, q, h, w] = sum_j core[i, j, h, w] down[j, q]; None when the shapes are no such triple."""
    if core.ndim != 4 or up.ndim != 2 or down.ndim != 2 or core.shape[0] != up.shape[0] or \
            core.shape[1] != down.shape[0] or 0 in core.shape + up.shape + down.shape:
        return None
    v = (core.transpose(0, 2, 3, 1) @ down).transpose(0, 3, 1, 2)          # (i, in, kh, kw)
    return up.T, v.reshape(v.shape[0], -1)


def _tucker_locon(path, slot):
    """LyCORIS's LoCon in Tucker form (use_tucker on a kh x kw convolution: lora_down (r, in, 1, 1), lora_mid
    (r, r, kh, kw) with the layer's stride and padding, lora_up (out, r, 1, 1); lycoris/modules/locon.py
    LoConModule, functional/locon.py diff_weight: dW = rebuild_tucker(mid, up, down) * alpha / r) as one plain
    convolution pair, in place: the 1x1 down then the kh x kw mid convolution are one kh x kw convolution (no bias
    between them, zero padding commutes with a 1x1 one), A[i, q] = sum_j mid[i, j] down[j, q] (r, in, kh, kw),
    B = up; r stays the rank (alpha / r), as LyCORIS and ComfyUI (weight_adapter/lora.py) scale it."""
    (key_m, mid), (key_a, down), (key_b, up) = slot.pop("mid"), slot["A"], slot["B"]
    if down.ndim == 4 and down.shape[2:] == (1, 1):
        down = down.reshape(down.shape[:2])
    if mid.ndim != 4 or down.ndim != 2 or up.ndim not in (2, 4) or up.shape[2:] not in ((), (1, 1)) or \
            mid.shape[:2] != (down.shape[0], down.shape[0]) or up.shape[1] != down.shape[0] or 0 in mid.shape:
        raise MlxdiffError(f"{path}: {_short(key_a)!r} {tuple(slot['A'][1].shape)}, {_short(key_m)!r} "
                           f"{tuple(mid.shape)}, {_short(key_b)!r} {tuple(up.shape)}: not a LoCon in Tucker form "
                           "(lora_down r x in x 1 x 1, lora_mid r x r x kh x kw, lora_up out x r x 1 x 1)")
    mid, down = mid.astype(mx.float32), down.astype(mx.float32)
    slot["A"] = (key_a, (mid.transpose(0, 2, 3, 1) @ down).transpose(0, 3, 1, 2))
    slot["factors"] = [key_b, key_a, key_m]
    slot["form"] = "LoCon (Tucker)"


def _lycoris(path, slot):
    """A LyCORIS LoHa / LoKr layer (also PEFT's LoHaConfig / LoKrConfig factors) as one exact low-rank pair, in
    place: slot["A"] (R, in [x kh x kw, flattened]) and slot["B"] (out, R) with B @ A = the weight change, its
    alpha / rank folded into B (the slot's alpha dropped), in float32 (the factors' products are not rounded).

    The math, as LyCORIS's own modules and PEFT compute it (read, not copied):
    - LoHa (lycoris/modules/loha.py LohaModule.get_weight -> functional/loha.py diff_weight;
      peft/tuners/loha/layer.py LoHaLayer.get_delta_weight): dW = (w1_a @ w1_b) * (w2_a @ w2_b) * alpha / r,
      r = w1_b's rows (LohaModule.make_module_from_state_dict: lora_dim). Its pair: B's columns w1_a[:, i] * w2_a[:, j],
      A's rows w1_b[i] * w2_b[j] (rank r1 x r2), exactly the Hadamard product.
    - LoKr (lycoris/modules/lokr.py LokrModule.get_weight -> functional/lokr.py make_kron;
      peft/tuners/lokr/layer.py LoKrLayer.get_delta_weight -> make_kron): dW = kron(w1, w2) * scale, w1 = lokr_w1
      or lokr_w1_a @ lokr_w1_b, w2 = lokr_w2 or lokr_w2_a @ lokr_w2_b; scale = alpha / r with r the decomposed
      factor's rank (w1_a's columns, else w2_a's: LokrModule.make_module_from_state_dict), and 1 when both factors
      are whole (LokrModule.__init__: "use scale = 1", alpha ignored). Its pair: kron(U1, U2), kron(V1, V2) of each
      factor's own pair (w = U @ V: its a / b factors, or the whole matrix and an identity).
    One scale, as PEFT, ComfyUI and the formula above apply it (LyCORIS's get_diff_weight multiplies get_weight's
    already-scaled weight by the scale once more; mlxdiff does not follow that).
    A pair whose rank would reach min(out, in) is the weight change itself and an identity. A convolution's w1_b /
    w2_b / lokr_w2 are (rows, in x kh x kw) flattened as PyTorch's weight (plan reshapes A to the layer's kernel).
    Tucker forms (a convolution's, use_tucker; `_tucker`): a LoHa's hada_t1 / hada_t2 (r, r, kh, kw) with hada_w1_a /
    hada_w2_a then (r, out) and hada_w1_b / hada_w2_b (r, in) (lycoris/modules/loha.py LohaModule.__init__,
    functional/loha.py HadaWeightTucker): each Hadamard side's rebuild is a rank-r pair (U, V) of its own, and the
    LoHa pair is built from those, its scale alpha / r (hada_w1_b's rows, as without Tucker); a LoKr's lokr_t2
    (r, r, kh, kw) with lokr_w2_a (r, out / a) and lokr_w2_b (r, in / c) (lycoris/modules/lokr.py LokrModule.__init__,
    functional/lokr.py _kron_weight -> rebuild_tucker): w2 = U2 @ V2 flattened, kron(w1, w2) as without Tucker, its
    scale alpha / r with r the core's rank (lokr_w2_b's rows, as ComfyUI's weight_adapter/lokr.py reads it and
    LokrModule trains it; LokrModule.make_module_from_state_dict would read lokr_w2_a's columns, the out size).
    """
    roles = [r for r in LYCORIS_FACTORS if r in slot]
    keys = [slot[r][0] for r in roles]
    for other in ("A", "B"):
        if other in slot:
            raise MlxdiffError(f"{path}: {_short(slot[other][0])!r} and {_short(keys[0])!r}: a plain LoRA and LyCORIS "
                               "factors on one layer; keep one")

    def get(role):
        return slot[role][1].astype(mx.float32) if role in slot else None

    def flat(m):
        return m.reshape(m.shape[0], -1) if m is not None and m.ndim > 2 else m

    def bad(what):
        shapes = ", ".join(f"{_short(slot[r][0])!r} {tuple(slot[r][1].shape)}" for r in roles)
        return MlxdiffError(f"{path}: {shapes}: {what}")
    alpha = None
    if "alpha" in slot:
        key, value = slot.pop("alpha")
        if value.size != 1:
            raise MlxdiffError(f"{path}: {_short(key)!r} must be one number, got shape {tuple(value.shape)}")
        alpha = float(value.reshape(-1)[0].astype(mx.float32).item())
        if not (math.isfinite(alpha) and alpha > 0):
            raise MlxdiffError(f"{path}: {_short(key)!r} is {alpha:g}, not a positive number; re-save the LoRA")
    if roles[0].startswith("hada_"):
        cores = [r for r in ("hada_t1", "hada_t2") if r in slot]
        if len(roles) - len(cores) != 4 or len(cores) == 1:
            raise bad("not a LoHa (it needs hada_w1_a, hada_w1_b, hada_w2_a and hada_w2_b; a Tucker LoHa also "
                      "hada_t1 and hada_t2)")
        w1a, w1b, w2a, w2b = (get(r) for r in LYCORIS_FACTORS[:4])
        rank = w1b.shape[0]
        if cores:
            sides = [_tucker(get(f"hada_t{i}"), wa, wb) for i, wa, wb in (("1", w1a, w1b), ("2", w2a, w2b))]
            if None in sides:
                raise bad("not a Tucker LoHa (hada_tN: r x r x kh x kw, hada_wN_a: r x out, hada_wN_b: r x in)")
            (w1a, w1b), (w2a, w2b) = sides
        w1b, w2b = flat(w1b), flat(w2b)
        if any(m.ndim != 2 for m in (w1a, w2a)) or w1a.shape[1] != w1b.shape[0] or w2a.shape[1] != w2b.shape[0] \
                or w1a.shape[0] != w2a.shape[0] or w1b.shape[1] != w2b.shape[1] or 0 in w1a.shape + w2a.shape:
            raise bad("not a LoHa (w1_a: out x r1, w1_b: r1 x in, w2_a: out x r2, w2_b: r2 x in)")
        scale = 1.0 if alpha is None else alpha / rank
        b = (w1a[:, :, None] * w2a[:, None, :]).reshape(w1a.shape[0], -1)
        a = (w1b[:, None, :] * w2b[None, :, :]).reshape(-1, w1b.shape[1])
    else:
        sides = []
        core = get("lokr_t2")
        for i in ("1", "2"):
            whole, fa, fb = get(f"lokr_w{i}"), get(f"lokr_w{i}_a"), get(f"lokr_w{i}_b")
            if (whole is None) == (fa is None and fb is None) or (fa is None) != (fb is None):
                raise bad(f"not a LoKr (it needs lokr_w{i}, or lokr_w{i}_a and lokr_w{i}_b)")
            if i == "2" and core is not None:
                pair = None if fa is None else _tucker(core, fa, fb)
                if pair is None:
                    raise bad("not a Tucker LoKr (lokr_t2: r x r x kh x kw, lokr_w2_a: r x out, lokr_w2_b: r x in)")
                sides.append((*pair, fb.shape[0]))
            elif whole is not None:
                whole = flat(whole) if i == "2" else whole
                if whole.ndim != 2 or 0 in whole.shape:
                    raise bad(f"lokr_w{i} is not a matrix")
                sides.append((*_low_rank(whole), None))
            else:
                fb = flat(fb) if i == "2" else fb
                if fa.ndim != 2 or fb.ndim != 2 or fa.shape[1] != fb.shape[0] or 0 in fa.shape + fb.shape:
                    raise bad(f"lokr_w{i}_a and lokr_w{i}_b are not a pair (rows x r, r x cols)")
                sides.append((fa, fb, fa.shape[1]))
        (u1, v1, r1), (u2, v2, r2) = sides
        rank = r1 if r1 is not None else r2
        scale = 1.0 if rank is None else (alpha / rank if alpha is not None else 1.0)
        b, a = _kron_factors(u1, u2), _kron_factors(v1, v2)
    if a.shape[0] >= min(b.shape[0], a.shape[1]):      # no smaller than the change itself
        b, a = _low_rank(b @ a)
    slot["A"] = (keys[-1], a)
    slot["B"] = (keys[0], b * scale)
    slot["factors"] = keys
    slot["form"] = ("LoHa" if roles[0].startswith("hada_") else "LoKr") + (" (Tucker)" if any(
        r in slot for r in ("hada_t1", "lokr_t2")) else "")
