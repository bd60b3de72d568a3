// The gated activation's (SwiGLU, GeGLU) autograd Function in C++ over the Triton kernels of
// triton_impl.py (gated_fwd_kernel, gated_bwd_kernel): the launches and arguments of its
// Python GatedFunction; a plan holds the two kernels compiled for one size and activation.
#include "native_launch.h"

namespace perfloop {
namespace {

struct Plan {
  int64_t fwd, bwd;  // kernel indices
  int64_t programs;
};

Registry<Plan>& plans() { return registry<Plan>(); }

int64_t add_plan(int64_t fwd, int64_t bwd, int64_t programs) {
  return plans().add(Plan{fwd, bwd, programs});
}

struct GatedFn : public torch::autograd::Function<GatedFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b, int64_t plan,
                            int64_t stream) {
    RECORD_FUNCTION("perfloop::gated", std::vector<c10::IValue>({a, b}));
    TORCH_CHECK(a.sizes() == b.sizes() && a.dtype() == b.dtype() && a.device() == b.device(),
                "perfloop gated activation: a and b need one shape, dtype and device");
    c10::DeviceGuard on_device(a.device());
    ensure_context(a.device().index());
    const Plan& p = plans().at(plan);
    const at::Tensor ac = packed(a);
    const at::Tensor bc = packed(b);
    at::Tensor y = at::empty_like(ac, at::MemoryFormat::Contiguous);
    launch(kernels().at(p.fwd), static_cast<unsigned>(p.programs), 1, 1, reinterpret_cast<void*>(stream),
           {ac, bc, y, ac.numel(), 0, 0});  // ACT, BLOCK: compiled in
    ctx->save_for_backward({ac, bc});
    ctx->saved_data["plan"] = plan;
    ctx->saved_data["stream"] = stream;
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    RECORD_FUNCTION("perfloop::gated_backward", std::vector<c10::IValue>({grads[0]}));
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& a = saved[0];
    const at::Tensor& b = saved[1];
    c10::DeviceGuard on_device(a.device());
    ensure_context(a.device().index());
    const Plan& p = plans().at(ctx->saved_data["plan"].toInt());
    const at::Tensor dy = packed(grads[0]);
    at::Tensor da = at::empty_like(a, at::MemoryFormat::Contiguous);
    at::Tensor db = at::empty_like(b, at::MemoryFormat::Contiguous);
    launch(kernels().at(p.bwd), static_cast<unsigned>(p.programs), 1, 1,
           reinterpret_cast<void*>(ctx->saved_data["stream"].toInt()), {a, b, dy, da, db, a.numel(), 0, 0});
    return {da, db, at::Tensor(), at::Tensor()};
  }
};

at::Tensor gated(const at::Tensor& a, const at::Tensor& b, int64_t plan, int64_t stream) {
  return GatedFn::apply(a, b, plan, stream);
}

}  // namespace
}  // namespace perfloop

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_kernel", &perfloop::add_kernel);
  m.def("add_plan", &perfloop::add_plan);
  m.def("gated", &perfloop::gated, "act(a) * b with its backward in C++ (a, b, plan, stream)");
}
