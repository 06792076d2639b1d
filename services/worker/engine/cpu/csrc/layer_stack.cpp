// A step's decoder layers in one call: what fused_llama.FusedLlama._native_layers does op by op from Python (fused
// RMSNorm, the planned linears, rotary, the K/V write, the paged attention kernels, SiLU * up, the residual adds), in
// the same order through the same functions of this translation unit, so the result is the same to the bit.
// Registered as torch.ops.conveyor_<isa>.layer_stack; the engine calls it for every step whose attention groups all
// go through the CPU kernels (decode rows: paged_decode; prefill chunks and drafts: prefill_attention) over a float32
// pool (fused_llama.py decides), else the Python loop runs.
//
// Why: at one to a few sequences a step is ~120 memory-bound linears of 1-7 MB with ~15 small ops between each
// pair, and each op crossed from Python (module call, GEMM-plan lookup, views, dispatch): ~4 ms of a ~26 ms step
// at one sequence on the 2-core Xeon of docs/benchmarks.md, time in which memory sits idle; a 128-token prefill
// pays the same ~4 ms of its ~115. Here the loop costs microseconds a layer.
//
// The last layer's o projection, MLP and their norms run on the rows whose hidden state is read afterwards (the
// logits rows: one a prompt that ends in this step, every decode row), not on a chunk's other rows, whose K/V the
// layer has written by then: ~2.8 % of a prefill chunk's linear work (fused_llama.FusedLlama.hidden).
//
// The linears take the kernel the GEMM plans chose for this row count (gemm.py measures them; `kernels` gives one
// code per linear in the order of gemm.KERNELS): the library ones through ATen or the dispatcher, the GEMV of this
// build directly, that of the avx2 build (gemv256) through the dispatcher; each with or without its L2 prefetches
// (the *_near codes: far_lines 0); the panel GEMM of this build on the layer's panel copy (gemm_kernels.COPIES), with
// its default tiles or 8-row ones at any row count (panel8); the GEMM on codes on the layer's coded copy (q4, q8).
//
// Each stage of a layer is a named range of torch.profiler's (layer_stack.qkv_proj, .attention, ...; RECORD_FUNCTION,
// which costs a flag test when no profiler runs): to the dispatcher the stack is one op, and the profile of a step
// showed it as one block of self time, the GEMMs of this build and the attention kernels inside it unnamed.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/index_copy.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mm.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

namespace {

// A stage of the stack as a profiler range (see the top of this file); one per block scope.
#define LAYER_STAGE(name) RECORD_FUNCTION(name, c10::ArrayRef<const c10::IValue>{})
constexpr const char* kLinearStage[4] = {"layer_stack.qkv_proj", "layer_stack.o_proj", "layer_stack.gate_up_proj",
                                         "layer_stack.down_proj"};

// gemm.KERNELS' order
enum LinearKernel : int64_t {
  kLinear = 0, kFlipped, kOnednn, kPacked, kGemv, kGemv256, kGemvNear, kGemv256Near, kPanel, kPanel8, kQ4, kQ8, kNumKernels
};

c10::IValue opt(const c10::optional<at::Tensor>& t) { return t.has_value() ? c10::IValue(*t) : c10::IValue(); }

at::Tensor boxed(const c10::OperatorHandle& op, torch::jit::Stack stack) {
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

at::Tensor linear_by(int64_t kernel, const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& b,
                     const c10::optional<at::Tensor>& packed, const c10::optional<at::Tensor>& panels,
                     const c10::optional<at::Tensor>& coded) {
  switch (kernel) {
    case kFlipped: {  // gemm._flipped
      at::Tensor y = at::mm(w, x.t()).t().contiguous();
      return b.has_value() ? at::add(y, *b) : y;
    }
    case kOnednn:
    case kPacked: {  // gemm._onednn / _packed: oneDNN's linear on the weight or its packed copy
      static const c10::OperatorHandle op =
          c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
      TORCH_CHECK(kernel == kOnednn || packed.has_value(), "layer_stack: a packed kernel without a packed weight");
      return boxed(op, {x, kernel == kPacked ? *packed : w, opt(b), std::string("none"),
                        c10::List<c10::optional<at::Scalar>>(), c10::optional<std::string>(std::string())});
    }
    case kGemv:
    case kGemvNear:
      return gemv(x, w, b, kernel == kGemv ? kFarLines : 0);
    case kGemv256:
    case kGemv256Near: {  // the avx2 build's GEMV, loaded beside this one (cpu_ops.narrow_ops)
      static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("conveyor_avx2::gemv", "");
      return boxed(op, {x, w, opt(b), kernel == kGemv256 ? kFarLines : int64_t{0}});
    }
    case kPanel:
    case kPanel8:
      TORCH_CHECK(panels.has_value(), "layer_stack: the panel kernel without a panel copy of the weight");
      return panel_gemm(x, *panels, b, w.size(0), kernel == kPanel8);
    case kQ4:
    case kQ8:
      TORCH_CHECK(coded.has_value(), "layer_stack: a coded kernel without the coded copy of the weight");
      return coded_gemm(x, *coded, b, w.size(0), kernel == kQ4 ? 4 : 8);
    default:
      return at::linear(x, w, b);
  }
}

// K and V of each row (columns [k0, k0 + n) and [v0, v0 + n) of qkv) into its slot of the layer's pool.
void write_kv(float* key, float* value, const at::Tensor& qkv, const int64_t* slots, int64_t k0, int64_t v0,
              int64_t n) {
  const float* p = qkv.data_ptr<float>();
  const int64_t rs = qkv.stride(0);
  for (int64_t t = 0; t < qkv.size(0); ++t) {
    std::memcpy(key + slots[t] * n, p + t * rs + k0, n * sizeof(float));
    std::memcpy(value + slots[t] * n, p + t * rs + v0, n * sizeof(float));
  }
}

// The step's attention groups, in row order: the decode rows first (paged_decode, when decode_first), then each
// prefill group (prefill_attention); each with its block tables and its context lengths or (start, len) spans.
struct Groups {
  at::TensorList block_tables, lens;
  at::IntArrayRef rows;  // each group's rows
  bool decode_first;

  void attend(at::Tensor& out, const at::Tensor& q, const at::Tensor& key, const at::Tensor& value,
              int64_t block_size, double scale, int64_t window) const {
    int64_t row = 0;
    for (size_t g = 0; g < rows.size(); ++g) {
      at::Tensor o = out.narrow(0, row, rows[g]), qg = q.narrow(0, row, rows[g]);
      auto kernel = g == 0 && decode_first ? paged_decode : prefill_attention;
      kernel(o, qg, key, value, block_tables[g], lens[g], block_size, scale, window);
      row += rows[g];
    }
  }
};

// What every run of a step's stack reads alike (layer_stack below): per layer six weights (qkv, o, gate_up, down,
// input norm, post-attention norm), four biases, four oneDNN packed copies, four panel copies and four coded copies
// (q4 or q8: qkv, o, gate_up, down; None where absent), four kernel codes and a window (0: none); key/value the pool
// [layers, slots, KVH, D] (float32); the three tail kernels (below).
struct Shared {
  at::TensorList weights;
  const c10::List<c10::optional<at::Tensor>>&biases, &packed, &panels, &coded;
  at::IntArrayRef kernels;
  const at::Tensor &key, &value;
  int64_t block_size;
  double scale;
  at::IntArrayRef windows;
  double eps;
  int64_t num_heads;
  at::IntArrayRef tail_kernels;
};

// A run of the stack over the rows h of a step: h [T, hidden] float32, the residual stream, updated in place;
// cos/sin [T, D]; slots [T]; the attention groups (Groups). keep [N] (rows of h, or None: all): past its attention
// the last layer runs on these rows only, each linear through its tail_kernels code (the plans' kernel for N rows);
// the kept rows of h end as the stack's output and the others keep the residual from before the last layer's
// attention.
void stack_rows(const Shared& shared, at::Tensor h, const at::Tensor& cos, const at::Tensor& sin,
                const at::Tensor& slots, const Groups& groups, const c10::optional<at::Tensor>& keep) {
  const auto& [weights, biases, packed, panels, coded, kernels, key, value, block_size, scale, windows, eps, num_heads,
               tail_kernels] = shared;
  const int64_t L = key.size(0), KVH = key.size(2), D = key.size(3), T = h.size(0), H = num_heads;
  TORCH_CHECK(h.scalar_type() == at::kFloat && h.dim() == 2 && h.is_contiguous(), "layer_stack: float32 h [T, n]");
  TORCH_CHECK(key.scalar_type() == at::kFloat && value.scalar_type() == at::kFloat && key.is_contiguous() &&
                  value.is_contiguous() && key.dim() == 4 && value.sizes() == key.sizes(),
              "layer_stack: contiguous float32 key/value pools [layers, slots, KVH, D]");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 6 * L && static_cast<int64_t>(biases.size()) == 4 * L &&
                  static_cast<int64_t>(packed.size()) == 4 * L && static_cast<int64_t>(panels.size()) == 4 * L &&
                  static_cast<int64_t>(coded.size()) == 4 * L && static_cast<int64_t>(kernels.size()) == 4 * L &&
                  static_cast<int64_t>(windows.size()) == L,
              "layer_stack: 6 weights, 4 biases, 4 packed, 4 panel and 4 coded copies, 4 kernels and a window per layer");
  for (const int64_t k : kernels) TORCH_CHECK(k >= 0 && k < kNumKernels, "layer_stack: kernel code ", k);
  TORCH_CHECK(!keep.has_value() || (keep->scalar_type() == at::kLong && keep->dim() == 1 && tail_kernels.size() == 3),
              "layer_stack: keep [N] long with three tail kernels (o, gate_up, down)");
  for (const int64_t k : tail_kernels) TORCH_CHECK(k >= 0 && k < kNumKernels, "layer_stack: kernel code ", k);
  TORCH_CHECK(groups.block_tables.size() == groups.rows.size() && groups.lens.size() == groups.rows.size() &&
                  !groups.rows.empty(),
              "layer_stack: block tables, lens and rows for each attention group");
  int64_t covered = 0;
  for (const int64_t r : groups.rows) covered += r;
  TORCH_CHECK(covered == T, "layer_stack: the attention groups cover ", covered, " rows of ", T);
  auto slot_ids = slots.contiguous();
  TORCH_CHECK(slot_ids.scalar_type() == at::kLong && slot_ids.numel() == T, "layer_stack: slots [T] long");
  const int64_t* slot_p = slot_ids.data_ptr<int64_t>();
  const int64_t per_slot = KVH * D;
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slot_p[t] >= 0 && slot_p[t] < key.size(1), "layer_stack: slot ", slot_p[t], " outside the pool");
  at::Tensor normed = at::empty_like(h), q = at::empty({T, H, D}, h.options()), attn = at::empty({T, H, D}, h.options());
  add_rms_norm(normed, h, c10::nullopt, weights[4], eps);
  for (int64_t i = 0; i < L; ++i) {
    auto lin = [&](int64_t j, const at::Tensor& in) {  // linear j of the layer: qkv, o, gate_up, down
      LAYER_STAGE(kLinearStage[j]);
      const int64_t at = 4 * i + j;
      return linear_by(kernels[at], in, weights[6 * i + j], biases.get(at), packed.get(at), panels.get(at),
                       coded.get(at));
    };
    at::Tensor qkv = lin(0, normed);
    at::Tensor key_l = key.select(0, i), value_l = value.select(0, i);
    {
      LAYER_STAGE("layer_stack.rotary_kv_write");
      rotary(qkv.narrow(1, 0, (H + KVH) * D).view({T, H + KVH, D}), cos, sin);
      write_kv(key_l.data_ptr<float>(), value_l.data_ptr<float>(), qkv, slot_p, H * D, (H + KVH) * D, per_slot);
      q.copy_(qkv.narrow(1, 0, H * D).view({T, H, D}));
    }
    {
      LAYER_STAGE("layer_stack.attention");
      groups.attend(attn, q, key_l, value_l, block_size, scale, windows[i]);
    }
    if (i + 1 == L && keep.has_value()) {  // the last layer past attention: only the rows read afterwards
      const at::Tensor rows = *keep;
      if (rows.numel() == 0) break;  // a chunk no row of which is read (a long prompt's middle)
      auto tail = [&](int64_t j, const at::Tensor& in) {
        LAYER_STAGE(kLinearStage[j]);
        const int64_t at = 4 * i + j;
        return linear_by(tail_kernels[j - 1], in, weights[6 * i + j], biases.get(at), packed.get(at), panels.get(at),
                       coded.get(at));
      };
      at::Tensor hs = h.index_select(0, rows), ns = at::empty_like(hs);
      add_rms_norm(ns, hs, tail(1, attn.view({T, H * D}).index_select(0, rows)), weights[6 * i + 5], eps);
      at::Tensor gu = tail(2, ns);
      at::Tensor act = at::empty({hs.size(0), gu.size(1) / 2}, h.options());
      silu_mul(act, gu);
      hs.add_(tail(3, act));
      h.index_copy_(0, rows, hs);
      break;
    }
    const at::Tensor o = lin(1, attn.view({T, H * D}));
    {
      LAYER_STAGE("layer_stack.norm");
      add_rms_norm(normed, h, o, weights[6 * i + 5], eps);
    }
    at::Tensor gate_up = lin(2, normed);
    at::Tensor act = at::empty({T, gate_up.size(1) / 2}, h.options());
    {
      LAYER_STAGE("layer_stack.silu_mul");
      silu_mul(act, gate_up);
    }
    at::Tensor mlp = lin(3, act);
    LAYER_STAGE("layer_stack.norm");
    if (i + 1 < L) {
      add_rms_norm(normed, h, mlp, weights[6 * (i + 1) + 4], eps);
    } else {
      h.add_(mlp);
    }
  }
}

// The stack, in `parts` runs of a decode step's sequences at once, one a thread (parts 1: the whole step, each op
// shared by the threads). Why: at 32 decode rows on two cores each of a step's ~300 ops split its work between the
// threads, and each split costs its fork and join and the end of the call where one thread waits for the other's
// last panel: in runs a decode step of 32 sequences took 53 ms against 57-59 whole, 16 and 64 sequences 1.02-1.03x
// (the Xeon of docs/benchmarks.md, 2026-12-07); 8 sequences in runs of 4 were 11 % slower (each run's GEMMs read all
// the weights for four rows: the split needs runs of 8 or more). Each run is the stack over its own rows, K/V slots,
// block tables and context lengths; ATen's parallel_for inside a run is inline (one thread each, shares.h's
// kernel_threads), so every kernel runs on one core.
// A run's rows see the same weights, and each row's result depends on its own run's kernels alone. Only a step of
// decode rows alone splits (a prompt's chunk attends over its own rows), with every row kept (no keep).
void layer_stack(at::Tensor h, const at::Tensor& cos, const at::Tensor& sin, at::TensorList weights,
                 const c10::List<c10::optional<at::Tensor>>& biases, const c10::List<c10::optional<at::Tensor>>& packed,
                 const c10::List<c10::optional<at::Tensor>>& panels, const c10::List<c10::optional<at::Tensor>>& coded,
                 at::IntArrayRef kernels, const at::Tensor& key, const at::Tensor& value, const at::Tensor& slots,
                 at::TensorList block_tables, at::TensorList lens, at::IntArrayRef rows, bool decode_first,
                 int64_t block_size, double scale, at::IntArrayRef windows, double eps, int64_t num_heads,
                 const c10::optional<at::Tensor>& keep, at::IntArrayRef tail_kernels, int64_t parts) {
  const int64_t T = h.size(0);
  TORCH_CHECK(parts >= 1 && parts <= std::max<int64_t>(T, 1), "layer_stack: parts ", parts, " for ", T, " rows");
  const Shared shared{weights, biases,     packed, panels,  coded, kernels,   key,
                      value,   block_size, scale,  windows, eps,   num_heads, tail_kernels};
  if (parts == 1) {
    stack_rows(shared, h, cos, sin, slots, Groups{block_tables, lens, rows, decode_first}, keep);
    return;
  }
  TORCH_CHECK(decode_first && rows.size() == 1 && !keep.has_value(),
              "layer_stack: only a step of decode rows alone, every row kept, splits into parts");
  const at::ThreadLocalState caller;  // inference mode and the profiler's state: a pool thread has the caller's
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    const at::ThreadLocalStateGuard as_caller(caller);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t r0 = T * p / parts, n = T * (p + 1) / parts - r0;
      const std::vector<at::Tensor> tables{block_tables[0].narrow(0, r0, n)}, part_lens{lens[0].narrow(0, r0, n)};
      const std::vector<int64_t> part_rows{n};
      stack_rows(shared, h.narrow(0, r0, n), cos.narrow(0, r0, n), sin.narrow(0, r0, n), slots.narrow(0, r0, n),
                 Groups{tables, part_lens, part_rows, true}, c10::nullopt);
    }
  });
}

}  // namespace

CONVEYOR_LIBRARY_FRAGMENT(CONVEYOR_NS, m) {
  m.def(
      "layer_stack(Tensor(a!) h, Tensor cos, Tensor sin, Tensor[] weights, Tensor?[] biases, Tensor?[] packed, "
      "Tensor?[] panels, Tensor?[] coded, int[] kernels, Tensor(b!) key, Tensor(c!) value, Tensor slots, Tensor[] block_tables, Tensor[] lens, "
      "int[] rows, bool decode_first, int block_size, float scale, int[] windows, float eps, int num_heads, "
      "Tensor? keep, int[] tail_kernels, int parts=1) -> ()");
  m.impl("layer_stack", c10::DispatchKey::CPU, TORCH_FN(layer_stack));
  // oneDNN's packed weight copies (gemm.pack) are MkldnnCPU tensors: with one among the operands, that key dispatches
  m.impl("layer_stack", c10::DispatchKey::MkldnnCPU, TORCH_FN(layer_stack));
}
