"""The Triton kernels of `attention.triton_decode` (split-K flash decoding over each slot's own length).

`triton` is an optional GPU dependency: without it this module defines nothing and `AVAILABLE` is False
(`attention.choose` then picks SDPA). Triton decides when a kernel is defined whether it runs compiled or in its
CPU interpreter (`TRITON_INTERPRET=1`), so a test that wants the interpreter sets that and reloads this module.
"""

try:
    import triton
    import triton.language as tl
except ImportError:  # no triton: SDPA decodes
    triton = None

AVAILABLE = triton is not None

if AVAILABLE:
    @triton.jit
    def block(q, kbase, vbase, n, end, m, l, acc, stride_kn, stride_vn, scale_log2, d, IEEE: tl.constexpr):
        """One block of cache entries `n` (those < end) into the online softmax (m, l, acc)."""
        inside = n < end
        k = tl.load(kbase + n[:, None] * stride_kn + d[None, :], mask=inside[:, None], other=0.0)
        if IEEE:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = tl.where(inside[None, :], scores * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        alpha = tl.where(m_new > float("-inf"), tl.exp2(m - m_new), 1.0)
        p = tl.where(inside[None, :], tl.exp2(scores - m_new[:, None]), 0.0)
        v = tl.load(vbase + n[:, None] * stride_vn + d[None, :], mask=inside[:, None], other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l * alpha + tl.sum(p, 1), acc


    @triton.jit
    def split_kernel(Q, K, V, Slots, Lengths, Ms, Ls, Accs, stride_qa, stride_qh, stride_ks, stride_kh, stride_kn,
                     stride_vs, stride_vh, stride_vn, scale_log2, SPLITS, CHUNK, H: tl.constexpr,
                     G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, IEEE: tl.constexpr,
                     DYNAMIC: tl.constexpr):
        a = tl.program_id(0)
        kvh = tl.program_id(1)
        s = tl.program_id(2)
        slot = tl.load(Slots + a).to(tl.int64)
        length = tl.load(Lengths + a)
        start = s * CHUNK
        end = tl.minimum(start + CHUNK, length)
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        heads = kvh * G + g
        rows = g < G
        q = tl.load(Q + a * stride_qa + heads[:, None] * stride_qh + d[None, :], mask=rows[:, None], other=0.0)
        m = tl.full([GP], float("-inf"), tl.float32)
        l = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        kbase = K + slot * stride_ks + kvh * stride_kh
        vbase = V + slot * stride_vs + kvh * stride_vh
        if DYNAMIC:  # on a GPU: only the blocks below the slot's length
            for n0 in range(start, end, BLOCK):
                m, l, acc = block(q, kbase, vbase, n0 + tl.arange(0, BLOCK), end, m, l, acc, stride_kn, stride_vn, scale_log2, d, IEEE)
        else:  # Triton's CPU interpreter takes no loop bounds read from memory: every block of the chunk, masked
            for n0 in range(0, CHUNK, BLOCK):
                m, l, acc = block(q, kbase, vbase, start + n0 + tl.arange(0, BLOCK), end, m, l, acc, stride_kn, stride_vn,
                                  scale_log2, d, IEEE)
        out = (a * H + heads) * SPLITS + s
        tl.store(Ms + out, m, mask=rows)
        tl.store(Ls + out, l, mask=rows)
        tl.store(Accs + out[:, None] * D + d[None, :], acc, mask=rows[:, None])


    @triton.jit
    def combine_kernel(Ms, Ls, Accs, Out, stride_oa, stride_oh, SPLITS, H: tl.constexpr, SP: tl.constexpr,
                       D: tl.constexpr):
        a = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.arange(0, SP)
        d = tl.arange(0, D)
        used = s < SPLITS
        base = (a * H + h) * SPLITS
        m = tl.load(Ms + base + s, mask=used, other=float("-inf"))
        l = tl.load(Ls + base + s, mask=used, other=0.0)
        top = tl.max(m, 0)
        w = tl.where(m > float("-inf"), tl.exp2(m - top), 0.0)  # a split past the slot's length holds nothing
        acc = tl.load(Accs + (base + s)[:, None] * D + d[None, :], mask=used[:, None], other=0.0)
        out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
        tl.store(Out + a * stride_oa + h * stride_oh + d, out.to(Out.dtype.element_ty))
