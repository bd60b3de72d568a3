// LayerNorm and RMSNorm's autograd Function in C++ over the Triton kernels of triton_impl.py
// (norm_fwd_kernel, norm_bwd_kernel, colsum_kernel): the same launches, with the same
// arguments, as its Python NormFunction; a plan holds the three kernels compiled for one shape.
#include "native_launch.h"

namespace perfloop {
namespace {

struct Plan {
  int64_t fwd, bwd, colsum;  // kernel indices
  int64_t programs;          // the backward's programs (g)
  int64_t rows_per_program;
  int64_t colsum_blocks;
};

Registry<Plan>& plans() { return registry<Plan>(); }

int64_t add_plan(int64_t fwd, int64_t bwd, int64_t colsum, int64_t programs, int64_t rows_per_program,
                 int64_t colsum_blocks) {
  return plans().add(Plan{fwd, bwd, colsum, programs, rows_per_program, colsum_blocks});
}

struct NormFn : public torch::autograd::Function<NormFn> {
  // bias: an optional argument, not an undefined tensor (autograd records each tensor's device)
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, double eps, int64_t plan, int64_t stream) {
    RECORD_FUNCTION("perfloop::norm", std::vector<c10::IValue>({x, weight}));
    const bool has_b = bias.has_value() && bias->defined();
    TORCH_CHECK(weight.device() == x.device() && (!has_b || bias->device() == x.device()),
                "perfloop norm: weight and bias must be on x's device (", x.device(), ")");
    TORCH_CHECK(weight.numel() == x.size(-1) && (!has_b || bias->numel() == x.size(-1)),
                "perfloop norm: weight and bias must have x's last dimension (", x.size(-1), ") elements");
    c10::DeviceGuard on_device(x.device());
    ensure_context(x.device().index());
    const Plan& p = plans().at(plan);
    const at::Tensor xc = packed(x);
    const at::Tensor w = packed(weight);
    const at::Tensor b = has_b ? packed(*bias) : w;
    const int64_t n = xc.size(-1);
    const int64_t m = xc.numel() / n;
    at::Tensor y = at::empty_like(xc, at::MemoryFormat::Contiguous);
    at::Tensor stats = at::empty({2, m}, xc.options().dtype(at::kFloat));  // mean, 1/std
    void* s = reinterpret_cast<void*>(stream);
    launch(kernels().at(p.fwd), static_cast<unsigned>(m), 1, 1, s,
           {xc, w, b, y, stats, n, n, m, n, eps, 0, 0, 0});  // RMS, HAS_B, BLOCK: compiled in
    ctx->save_for_backward({xc, w, stats});
    ctx->saved_data["plan"] = plan;
    ctx->saved_data["stream"] = stream;
    ctx->saved_data["has_b"] = has_b;
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    RECORD_FUNCTION("perfloop::norm_backward", std::vector<c10::IValue>({grads[0]}));
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& w = saved[1];
    const at::Tensor& stats = saved[2];
    c10::DeviceGuard on_device(x.device());
    ensure_context(x.device().index());
    const Plan& p = plans().at(ctx->saved_data["plan"].toInt());
    void* s = reinterpret_cast<void*>(ctx->saved_data["stream"].toInt());
    const bool has_b = ctx->saved_data["has_b"].toBool();
    const at::Tensor dy = packed(grads[0]);
    const int64_t n = x.size(-1);
    const int64_t m = x.numel() / n;
    const int64_t slabs = has_b ? 2 : 1;
    at::Tensor dx = at::empty_like(x, at::MemoryFormat::Contiguous);
    at::Tensor partial = at::empty({slabs, p.programs, n}, x.options().dtype(at::kFloat));
    at::Tensor sums = has_b ? at::empty({2, n}, w.options()) : at::empty({n}, w.options());
    launch(kernels().at(p.bwd), static_cast<unsigned>(p.programs), 1, 1, s,
           {x, w, dy, dx, stats, partial, n, n, n, m, n, p.rows_per_program, 0, 0, 0, 0});
    launch(kernels().at(p.colsum), static_cast<unsigned>(p.colsum_blocks), static_cast<unsigned>(slabs), 1, s,
           {partial, sums, p.programs, n, 0, 0});
    if (has_b) return {dx, sums[0], sums[1], at::Tensor(), at::Tensor(), at::Tensor()};
    return {dx, sums, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor norm(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias, double eps,
                int64_t plan, int64_t stream) {
  return NormFn::apply(x, weight, bias, eps, plan, stream);
}

}  // namespace
}  // namespace perfloop

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_kernel", &perfloop::add_kernel);
  m.def("add_plan", &perfloop::add_plan);
  m.def("norm", &perfloop::norm, "the fused norm with its backward in C++ (x, weight, bias or None, eps, plan, stream)");
  m.def("pack_for_test", &perfloop::pack_for_test);
}
