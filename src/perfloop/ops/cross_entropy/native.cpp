// Cross entropy's autograd Function in C++ over the Triton kernels of triton_impl.py
// (ce_fwd_kernel, ce_mean_kernel, ce_bwd_kernel): the launches and arguments of its Python
// CrossEntropyFunction; a plan holds the three kernels compiled for one shape, row stride,
// ignore_index and loss dtype.
#include "native_launch.h"

namespace perfloop {
namespace {

struct Plan {
  int64_t fwd, mean, bwd;  // kernel indices
};

Registry<Plan>& plans() { return registry<Plan>(); }

int64_t add_plan(int64_t fwd, int64_t mean, int64_t bwd) { return plans().add(Plan{fwd, mean, bwd}); }

// The logits as the kernels read them: rows of unit stride (any row stride), 16-byte aligned;
// a copy only where they are not (as the Python Function's `.contiguous()`).
at::Tensor rows_of(const at::Tensor& logits) {
  if (logits.stride(1) == 1 && reinterpret_cast<uintptr_t>(logits.data_ptr()) % 16 == 0) return logits;
  return packed(logits.contiguous());
}

struct CrossEntropyFn : public torch::autograd::Function<CrossEntropyFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& target,
                            const at::Tensor& ok, int64_t ignore_index, bool fp32_loss, int64_t plan,
                            int64_t stream) {
    RECORD_FUNCTION("perfloop::cross_entropy", std::vector<c10::IValue>({logits, target}));
    TORCH_CHECK(logits.dim() == 2 && target.dim() == 1 && target.size(0) == logits.size(0),
                "perfloop cross entropy: logits (N, C) and targets (N,) needed, got ", logits.sizes(), " and ",
                target.sizes());
    TORCH_CHECK(target.scalar_type() == at::kLong, "perfloop cross entropy: targets must be int64 class indices");
    TORCH_CHECK(target.device() == logits.device() && ok.device() == logits.device(),
                "perfloop cross entropy: targets must be on the logits' device (", logits.device(), ")");
    c10::DeviceGuard on_device(logits.device());
    ensure_context(logits.device().index());
    const Plan& p = plans().at(plan);
    const at::Tensor l = rows_of(logits);
    const at::Tensor t = packed(target);
    const int64_t m = l.size(0);
    const int64_t v = l.size(1);
    at::Tensor lse = at::empty({m}, l.options().dtype(at::kFloat));
    at::Tensor loss = at::empty({m}, l.options().dtype(at::kFloat));
    at::Tensor mean = at::empty({}, l.options().dtype(fp32_loss ? at::kFloat : l.scalar_type()));
    at::Tensor n_valid = at::empty({}, t.options());
    void* s = reinterpret_cast<void*>(stream);
    launch(kernels().at(p.fwd), static_cast<unsigned>(m), 1, 1, s,
           {l, t, lse, loss, ok, l.stride(0), v, ignore_index, 0});  // BLOCK: compiled in
    at::_assert_async(ok, "cross entropy: a target is out of bounds");
    launch(kernels().at(p.mean), 1, 1, 1, s, {loss, t, mean, n_valid, m, ignore_index, 0});
    ctx->save_for_backward({l, t, lse, n_valid});
    ctx->saved_data["plan"] = plan;
    ctx->saved_data["stream"] = stream;
    ctx->saved_data["ignore_index"] = ignore_index;
    return mean;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    RECORD_FUNCTION("perfloop::cross_entropy_backward", std::vector<c10::IValue>({grads[0]}));
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& l = saved[0];
    const at::Tensor& t = saved[1];
    c10::DeviceGuard on_device(l.device());
    ensure_context(l.device().index());
    const Plan& p = plans().at(ctx->saved_data["plan"].toInt());
    const at::Tensor dloss = packed(grads[0]);
    const int64_t m = l.size(0);
    const int64_t v = l.size(1);
    at::Tensor dl = at::empty({m, v}, l.options());
    launch(kernels().at(p.bwd), static_cast<unsigned>(m), 1, 1,
           reinterpret_cast<void*>(ctx->saved_data["stream"].toInt()),
           {l, t, saved[2], dl, dloss, saved[3], l.stride(0), v, v, ctx->saved_data["ignore_index"].toInt(), 0});
    return {dl, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor cross_entropy(const at::Tensor& logits, const at::Tensor& target, const at::Tensor& ok,
                         int64_t ignore_index, bool fp32_loss, int64_t plan, int64_t stream) {
  return CrossEntropyFn::apply(logits, target, ok, ignore_index, fp32_loss, plan, stream);
}

}  // namespace
}  // namespace perfloop

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_kernel", &perfloop::add_kernel);
  m.def("add_plan", &perfloop::add_plan);
  m.def("cross_entropy", &perfloop::cross_entropy,
        "the mean cross entropy with its backward in C++ (logits, target, ok flag, ignore_index, fp32 loss?, "
        "plan, stream)");
}
