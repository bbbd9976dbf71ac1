// minirt's CPU kernels as torch operators (torch.ops.minirt.*): the schemas are checked by torch's
// dispatcher, each call is named in torch.profiler by itself, and the arguments are checked here
// (dtype, shape, layout) with errors naming the argument. The kernels are built once per
// instruction set (kernels.h); the best the CPU runs is picked when the library loads
// (MINIRT_KERNEL_ISA=generic|v3|v4|v4bf16 picks one; use_isa() switches, for tests and A/B).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <omp.h>
#include <sched.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "kernels.h"

extern "C" {
#define DECLARE_GENERIC(R, N, A) R minirt_generic_##N A;
MINIRT_KERNELS(DECLARE_GENERIC)
#ifdef MINIRT_X86_VARIANTS
#define DECLARE_V3(R, N, A) R minirt_v3_##N A;
#define DECLARE_V4(R, N, A) R minirt_v4_##N A;
#define DECLARE_V4BF16(R, N, A) R minirt_v4bf16_##N A;
MINIRT_KERNELS(DECLARE_V3)
MINIRT_KERNELS(DECLARE_V4)
MINIRT_KERNELS(DECLARE_V4BF16)
#endif
}

namespace {

struct Kernels {
    const char *isa;
#define FIELD(R, N, A) R(*N) A;
    MINIRT_KERNELS(FIELD)
};

#define GENERIC_PTR(R, N, A) &minirt_generic_##N,
const Kernels generic = {"generic", MINIRT_KERNELS(GENERIC_PTR)};
#ifdef MINIRT_X86_VARIANTS
#define V3_PTR(R, N, A) &minirt_v3_##N,
#define V4_PTR(R, N, A) &minirt_v4_##N,
#define V4BF16_PTR(R, N, A) &minirt_v4bf16_##N,
const Kernels v3 = {"v3", MINIRT_KERNELS(V3_PTR)};
const Kernels v4 = {"v4", MINIRT_KERNELS(V4_PTR)};
const Kernels v4bf16 = {"v4bf16", MINIRT_KERNELS(V4BF16_PTR)};
#endif

// the builds this CPU can run, best last
std::vector<const Kernels *> runnable() {
    std::vector<const Kernels *> out = {&generic};
#ifdef MINIRT_X86_VARIANTS
    __builtin_cpu_init();
    if (__builtin_cpu_supports("x86-64-v3")) out.push_back(&v3);
    if (__builtin_cpu_supports("x86-64-v4")) {
        out.push_back(&v4);
        if (__builtin_cpu_supports("avx512bf16")) out.push_back(&v4bf16);
    }
#endif
    return out;
}

const Kernels *find(const std::string &name) {
    auto ok = runnable();
    if (name.empty() || name == "auto") return ok.back();
    for (auto *k : ok)
        if (name == k->isa) return k;
    std::string have;
    for (auto *k : ok) have += std::string(have.empty() ? "" : ", ") + k->isa;
    TORCH_CHECK(false, "minirt kernels: instruction set '", name,
                "' is not one this CPU runs (it runs: auto, ", have, ")");
    return nullptr;
}

const Kernels *pick_at_load() {
    const char *env = std::getenv("MINIRT_KERNEL_ISA");
    return find(env ? env : "auto");
}

const Kernels *active = nullptr;  // picked on first use: a bad MINIRT_KERNEL_ISA is an op's error

const Kernels *K() {
    if (active == nullptr) active = pick_at_load();
    return active;
}

void expect(const at::Tensor &t, const char *arg, at::ScalarType dtype, int64_t dim) {
    TORCH_CHECK(t.device().is_cpu(), arg, ": a CPU tensor expected");
    TORCH_CHECK(t.scalar_type() == dtype, arg, ": ", dtype, " expected, got ", t.scalar_type());
    TORCH_CHECK(t.dim() == dim, arg, ": ", dim, " dimensions expected, got ", t.dim());
}

void expect_float(const at::Tensor &t, const char *arg, int64_t dim) {
    TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, arg,
                ": float32 or bfloat16 expected, got ", t.scalar_type());
    expect(t, arg, t.scalar_type(), dim);
}

at::Tensor rope(const at::Tensor &x, const at::Tensor &cos, const at::Tensor &sin_signed,
                const at::Tensor &positions) {
    expect(x, "x", at::kFloat, 3);
    TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == x.size(2), "x: each row's heads contiguous");
    expect(cos, "cos", at::kFloat, 2);
    expect(sin_signed, "sin_signed", at::kFloat, 2);
    TORCH_CHECK(cos.is_contiguous() && sin_signed.is_contiguous(), "cos, sin_signed: contiguous");
    TORCH_CHECK(cos.size(1) == x.size(2) && sin_signed.sizes() == cos.sizes(),
                "cos, sin_signed: [positions, ", x.size(2), "] expected");
    expect(positions, "positions", at::kLong, 1);
    TORCH_CHECK(positions.size(0) == x.size(0), "positions: one per row of x");
    auto pos = positions.contiguous();
    auto out = at::empty(x.sizes(), x.options());
    K()->rope_f32(x.data_ptr<float>(), x.stride(0), cos.data_ptr<float>(),
                     sin_signed.data_ptr<float>(), pos.data_ptr<int64_t>(), x.size(0), x.size(1),
                     x.size(2), out.data_ptr<float>());
    return out;
}

at::Tensor rms_norm(const at::Tensor &x, const at::Tensor &weight, double eps) {
    expect(x, "x", at::kFloat, 2);
    TORCH_CHECK(x.stride(1) == 1, "x: rows contiguous");
    expect(weight, "weight", at::kFloat, 1);
    TORCH_CHECK(weight.size(0) == x.size(1), "weight: ", x.size(1), " elements expected");
    auto w = weight.contiguous();
    auto out = at::empty(x.sizes(), x.options());
    K()->rms_norm_f32(x.data_ptr<float>(), x.stride(0), w.data_ptr<float>(), x.size(0),
                         x.size(1), static_cast<float>(eps), out.data_ptr<float>());
    return out;
}

at::Tensor argmax(const at::Tensor &logits) {
    expect(logits, "logits", at::kFloat, 2);
    TORCH_CHECK(logits.stride(1) == 1 && logits.size(1) > 0, "logits: non-empty contiguous rows");
    auto out = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
    K()->argmax_f32(logits.data_ptr<float>(), logits.stride(0), logits.size(0), logits.size(1),
                       out.data_ptr<int64_t>());
    return out;
}

// rows: which rows of logits (checked), contiguous on return
at::Tensor logit_rows(const at::Tensor &logits, const at::Tensor &rows) {
    expect(logits, "logits", at::kFloat, 2);
    TORCH_CHECK(logits.stride(1) == 1 && logits.size(1) > 0, "logits: non-empty contiguous rows");
    expect(rows, "rows", at::kLong, 1);
    auto r = rows.contiguous();
    auto rp = r.data_ptr<int64_t>();
    for (int64_t i = 0; i < r.size(0); i++)
        TORCH_CHECK(rp[i] >= 0 && rp[i] < logits.size(0), "rows: ", rp[i], " is not a row of logits");
    return r;
}

at::Tensor sample(const at::Tensor &logits, const at::Tensor &rows, const at::Tensor &inv_temp,
                  const at::Tensor &floor, const at::Tensor &log_min_p, const at::Tensor &u) {
    auto r = logit_rows(logits, rows);
    int64_t n = r.size(0);
    expect(inv_temp, "inv_temp", at::kFloat, 1);
    expect(floor, "floor", at::kFloat, 1);
    expect(log_min_p, "log_min_p", at::kFloat, 1);
    expect(u, "u", at::kDouble, 1);
    TORCH_CHECK(inv_temp.size(0) == n && floor.size(0) == n && log_min_p.size(0) == n &&
                    u.size(0) == n,
                "inv_temp, floor, log_min_p, u: one per row");
    auto t = inv_temp.contiguous(), f = floor.contiguous(), lm = log_min_p.contiguous();
    auto w = u.contiguous();
    auto out = at::empty({n}, logits.options().dtype(at::kLong));
    K()->sample_f32(logits.data_ptr<float>(), logits.stride(0), r.data_ptr<int64_t>(), n,
                    logits.size(1), t.data_ptr<float>(), f.data_ptr<float>(),
                    lm.data_ptr<float>(), w.data_ptr<double>(), out.data_ptr<int64_t>());
    return out;
}

at::Tensor topk_values(const at::Tensor &logits, const at::Tensor &rows, int64_t k) {
    auto r = logit_rows(logits, rows);
    TORCH_CHECK(k >= 1, "k: at least 1, got ", k);
    auto out = at::empty({r.size(0), k}, logits.options());
    K()->topk_f32(logits.data_ptr<float>(), logits.stride(0), r.data_ptr<int64_t>(), r.size(0),
                  logits.size(1), k, out.data_ptr<float>());
    return out;
}

at::Tensor silu_mul(const at::Tensor &gate_up) {
    expect_float(gate_up, "gate_up", 2);
    TORCH_CHECK(gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
                "gate_up: contiguous rows of an even length (gate, then up)");
    int64_t rows = gate_up.size(0), f = gate_up.size(1) / 2;
    auto out = at::empty({rows, f}, gate_up.options());
    if (gate_up.scalar_type() == at::kFloat)
        K()->silu_mul_f32(gate_up.data_ptr<float>(), gate_up.stride(0), rows, f,
                             out.data_ptr<float>());
    else
        K()->silu_mul_bf16(static_cast<const uint16_t *>(gate_up.data_ptr()), gate_up.stride(0),
                              rows, f, static_cast<uint16_t *>(out.data_ptr()));
    return out;
}

void kv_write(at::Tensor &cache, const at::Tensor &slots, const at::Tensor &x) {
    expect_float(x, "x", 3);
    TORCH_CHECK(x.stride(2) == 1, "x: each head's vector contiguous");
    expect(cache, "cache", x.scalar_type(), 3);
    TORCH_CHECK(cache.is_contiguous(), "cache: contiguous");
    TORCH_CHECK(cache.size(0) == x.size(1) && cache.size(2) == x.size(2),
                "cache: [", x.size(1), " heads, slots, ", x.size(2), "] expected");
    expect(slots, "slots", at::kLong, 1);
    TORCH_CHECK(slots.size(0) == x.size(0), "slots: one per row of x");
    auto s = slots.contiguous();
    int64_t es = x.element_size(), num_slots = cache.size(1);
    int64_t bad = K()->kv_write(static_cast<const char *>(x.data_ptr()), x.stride(0) * es,
                                   x.stride(1) * es, s.data_ptr<int64_t>(), x.size(0),
                                   cache.size(0), cache.size(2) * es, num_slots,
                                   static_cast<char *>(cache.data_ptr()));
    TORCH_CHECK_INDEX(bad == 0, bad, " KV slot(s) outside the cache's ", num_slots, " slots");
}

at::Tensor paged_decode(const at::Tensor &q, const at::Tensor &kc, const at::Tensor &vc,
                        const at::Tensor &tables, const at::Tensor &lens, int64_t block_size,
                        double scale, bool portable) {
    expect_float(q, "q", 3);
    expect(kc, "kc", q.scalar_type(), 3);
    expect(vc, "vc", q.scalar_type(), 3);
    TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous() && vc.sizes() == kc.sizes(),
                "kc, vc: contiguous, of one shape");
    TORCH_CHECK(kc.size(2) == q.size(2), "kc: head_dim ", q.size(2), " expected");
    TORCH_CHECK(q.size(1) % kc.size(0) == 0, "q: heads a multiple of the cache's KV heads");
    expect(tables, "tables", at::kLong, 2);
    expect(lens, "lens", at::kLong, 1);
    TORCH_CHECK(tables.size(0) == q.size(0) && lens.size(0) == q.size(0),
                "tables, lens: one row per query");
    TORCH_CHECK(block_size > 0 && kc.size(1) % block_size == 0, "block_size: divides the slots");
    auto qc = q.contiguous();
    auto tc = tables.contiguous(), lc = lens.contiguous();
    auto out = at::empty_like(qc);
    auto fn = q.scalar_type() == at::kFloat ? K()->paged_decode_f32 : K()->paged_decode_bf16;
    fn(qc.data_ptr(), kc.data_ptr(), vc.data_ptr(), tc.data_ptr<int64_t>(), lc.data_ptr<int64_t>(), q.size(0), q.size(1), kc.size(0), q.size(2), block_size,
       kc.size(1), tables.size(1), static_cast<float>(scale), out.data_ptr(), portable);
    return out;
}

at::Tensor pack_rows(const at::Tensor &weight) {
    expect_float(weight, "weight", 2);
    auto w = weight.contiguous();
    int64_t n = w.size(0), k = w.size(1);
    if (w.scalar_type() == at::kBFloat16) {
        TORCH_CHECK(K()->rows_gemm_bf16_vector(), "pack_rows: no bfloat16 row kernel in the ",
                    K()->isa, " build");
        TORCH_CHECK(k % 2 == 0, "weight: an even number of columns expected in bfloat16");
        auto out = at::empty({K()->rows_packed_len_bf16(n, k)}, w.options().dtype(at::kInt));
        K()->rows_pack_bf16(static_cast<const uint16_t *>(w.data_ptr()), n, k,
                               static_cast<uint32_t *>(out.data_ptr()));
        return out;
    }
    TORCH_CHECK(K()->rows_gemm_vector(), "pack_rows: no row kernel in the ", K()->isa,
                " build");
    auto out = at::empty({K()->rows_packed_len(n, k)}, w.options());
    K()->rows_pack_f32(w.data_ptr<float>(), n, k, out.data_ptr<float>());
    return out;
}

at::Tensor rows_linear(const at::Tensor &x, const at::Tensor &packed,
                       const std::optional<at::Tensor> &bias, int64_t n) {
    expect_float(x, "x", 2);
    TORCH_CHECK(x.stride(1) == 1, "x: rows contiguous");
    int64_t m = x.size(0), k = x.size(1);
    bool bf16 = x.scalar_type() == at::kBFloat16;
    expect(packed, "packed", bf16 ? at::kInt : at::kFloat, 1);
    TORCH_CHECK(packed.is_contiguous(), "packed: contiguous");
    auto want = bf16 ? K()->rows_packed_len_bf16(n, k) : K()->rows_packed_len(n, k);
    TORCH_CHECK(packed.numel() == want, "packed: pack_rows of a [", n, ", ", k, "] weight expected");
    TORCH_CHECK(!bf16 || (x.stride(0) % 2 == 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 4 == 0),
                "x: bfloat16 rows at an even stride, 4-byte aligned");
    std::optional<at::Tensor> b;
    if (bias.has_value()) {
        expect(*bias, "bias", x.scalar_type(), 1);
        TORCH_CHECK(bias->size(0) == n, "bias: ", n, " elements expected");
        b = bias->contiguous();
    }
    auto scratch_len = bf16 ? K()->rows_scratch_len_bf16(m, k) : K()->rows_scratch_len(m, k);
    auto scratch = at::empty({scratch_len}, packed.options());
    auto out = at::empty({m, n}, x.options());
    if (bf16) {
        TORCH_CHECK(K()->rows_gemm_bf16_vector(), "rows_linear: no bfloat16 row kernel in the ",
                    K()->isa, " build");
        K()->rows_gemm_bf16(
            static_cast<const uint16_t *>(x.data_ptr()), x.stride(0), m,
            static_cast<const uint32_t *>(packed.data_ptr()),
            b ? static_cast<const uint16_t *>(b->data_ptr()) : nullptr, n, k,
            static_cast<uint32_t *>(scratch.data_ptr()), static_cast<uint16_t *>(out.data_ptr()));
    } else {
        TORCH_CHECK(K()->rows_gemm_vector(), "rows_linear: no row kernel in the ", K()->isa,
                    " build");
        K()->rows_gemm_f32(x.data_ptr<float>(), x.stride(0), m, packed.data_ptr<float>(),
                              b ? b->data_ptr<float>() : nullptr, n, k, scratch.data_ptr<float>(),
                              out.data_ptr<float>());
    }
    return out;
}

// y[t] += each row's own LoRA product (lora.c): y, x [T, *] rows contiguous, a [S, PR, K],
// b [S, PR, N] contiguous, of one dtype; slots [T] int64 (-1: none); scale [S] float32; off [P+1].
void lora_add(at::Tensor &y, const at::Tensor &x, const at::Tensor &a, const at::Tensor &b,
              const at::Tensor &slots, const at::Tensor &scale, const at::Tensor &off) {
    expect_float(x, "x", 2);
    expect(y, "y", x.scalar_type(), 2);
    expect(a, "a", x.scalar_type(), 3);
    expect(b, "b", x.scalar_type(), 3);
    expect(slots, "slots", at::kLong, 1);
    expect(scale, "scale", at::kFloat, 1);
    expect(off, "off", at::kLong, 1);
    TORCH_CHECK(x.stride(1) == 1 && y.stride(1) == 1, "x, y: rows contiguous");
    TORCH_CHECK(a.is_contiguous() && b.is_contiguous() && slots.is_contiguous() &&
                    scale.is_contiguous() && off.is_contiguous(),
                "a, b, slots, scale, off: contiguous");
    int64_t T = x.size(0), Kin = x.size(1), N = y.size(1), S = a.size(0), PR = a.size(1);
    int64_t P = off.size(0) - 1;
    TORCH_CHECK(y.size(0) == T && slots.size(0) == T, "y, slots: one row per row of x");
    TORCH_CHECK(a.size(2) == Kin, "a: [slots, parts x rank, ", Kin, "] expected");
    TORCH_CHECK(b.size(0) == S && b.size(1) == PR && b.size(2) == N,
                "b: [", S, ", ", PR, ", ", N, "] expected");
    TORCH_CHECK(scale.size(0) == S, "scale: one per slot");
    TORCH_CHECK(P >= 1 && PR % P == 0 && PR <= 512, "off: parts dividing a's rows, at most 512");
    auto o = off.data_ptr<int64_t>();
    TORCH_CHECK(o[0] >= 0 && o[P] <= N, "off: columns within y");
    auto sl = slots.data_ptr<int64_t>();
    for (int64_t t = 0; t < T; t++) TORCH_CHECK(sl[t] >= -1 && sl[t] < S, "slots: a slot or -1");
    auto scratch = at::empty({3 * S + 1 + 2 * T}, slots.options());  // the rows by slot
    int64_t *sc = scratch.data_ptr<int64_t>();
    if (x.scalar_type() == at::kFloat) {
        K()->lora_add_f32(x.data_ptr<float>(), x.stride(0), a.data_ptr<float>(),
                          b.data_ptr<float>(), sl, scale.data_ptr<float>(), o, T, Kin, N, PR, P,
                          S, sc, y.data_ptr<float>(), y.stride(0));
    } else {
        K()->lora_add_bf16(static_cast<const uint16_t *>(x.data_ptr()), x.stride(0),
                           static_cast<const uint16_t *>(a.data_ptr()),
                           static_cast<const uint16_t *>(b.data_ptr()), sl,
                           scale.data_ptr<float>(), o, T, Kin, N, PR, P, S, sc,
                           static_cast<uint16_t *>(y.data_ptr()), y.stride(0));
    }
}

bool has_vector(std::string kernel, int64_t head_dim) {
    if (kernel == "paged_decode_f32") return K()->paged_decode_vector(0, head_dim);
    if (kernel == "paged_decode_bf16") return K()->paged_decode_vector(1, head_dim);
    if (kernel == "rows_f32") return K()->rows_gemm_vector();
    if (kernel == "rows_bf16") return K()->rows_gemm_bf16_vector();
    TORCH_CHECK(false, "has_vector: kernel must be paged_decode_f32, paged_decode_bf16, rows_f32 "
                       "or rows_bf16, not '", kernel, "'");
    return false;
}

std::string isa() { return K()->isa; }

std::string use_isa(std::string name) {
    std::string before = K()->isa;
    active = find(name);
    return before;
}

std::vector<std::string> isas() {
    std::vector<std::string> out;
    for (auto *k : runnable()) out.emplace_back(k->isa);
    return out;
}

// Pin each thread of the OpenMP pool (torch's: the kernels link its libgomp, setup.py) to one
// CPU, thread i to cpus[i % n], as vLLM's CPU worker binds its threads; the calling thread is the
// pool's thread 0. Returns the CPU each thread got, -1 where the kernel refused.
std::vector<int64_t> bind_threads(std::vector<int64_t> cpus) {
    TORCH_CHECK(!cpus.empty(), "bind_threads: cpus must not be empty");
    for (auto c : cpus) TORCH_CHECK(c >= 0 && c < CPU_SETSIZE, "bind_threads: no CPU ", c);
    int n = omp_get_max_threads();
    std::vector<int64_t> got(n, -1);
#pragma omp parallel num_threads(n)
    {
        int t = omp_get_thread_num();
        int64_t cpu = cpus[t % cpus.size()];
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(static_cast<int>(cpu), &set);
        if (sched_setaffinity(0, sizeof(set), &set) == 0) got[t] = cpu;
    }
    return got;
}

}  // namespace

TORCH_LIBRARY(minirt, m) {
    m.def("rope(Tensor x, Tensor cos, Tensor sin_signed, Tensor positions) -> Tensor");
    m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
    m.def("argmax(Tensor logits) -> Tensor");
    m.def("sample(Tensor logits, Tensor rows, Tensor inv_temp, Tensor floor, Tensor log_min_p, "
          "Tensor u) -> Tensor");
    m.def("topk_values(Tensor logits, Tensor rows, int k) -> Tensor");
    m.def("silu_mul(Tensor gate_up) -> Tensor");
    m.def("kv_write(Tensor(a!) cache, Tensor slots, Tensor x) -> ()");
    m.def("paged_decode(Tensor q, Tensor kc, Tensor vc, Tensor tables, Tensor lens, "
          "int block_size, float scale, bool portable=False) -> Tensor");
    m.def("pack_rows(Tensor weight) -> Tensor");
    m.def("rows_linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
    m.def("lora_add(Tensor(a!) y, Tensor x, Tensor a, Tensor b, Tensor slots, Tensor scale, "
          "Tensor off) -> ()");
    m.def("has_vector(str kernel, int head_dim=0) -> bool", &has_vector);
    m.def("isa() -> str", &isa);
    m.def("isas() -> str[]", &isas);
    m.def("use_isa(str name) -> str", &use_isa);
    m.def("bind_threads(int[] cpus) -> int[]", &bind_threads);
}

TORCH_LIBRARY_IMPL(minirt, CPU, m) {
    m.impl("rope", &rope);
    m.impl("rms_norm", &rms_norm);
    m.impl("argmax", &argmax);
    m.impl("sample", &sample);
    m.impl("topk_values", &topk_values);
    m.impl("silu_mul", &silu_mul);
    m.impl("kv_write", &kv_write);
    m.impl("paged_decode", &paged_decode);
    m.impl("pack_rows", &pack_rows);
    m.impl("rows_linear", &rows_linear);
    m.impl("lora_add", &lora_add);
}
