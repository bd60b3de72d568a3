// FlashAttention's autograd Function in C++ over the Triton kernels of triton_kernels.py
// (attn_fwd_kernel, attn_bwd_preprocess, attn_bwd_dkdv_kernel, attn_bwd_dq_kernel): the launches and arguments
// of its Python FlashAttention; a plan holds the four kernels compiled (with the tiles that fit
// this GPU) for one shape, layout and dtype.
#include "native_launch.h"

namespace perfloop {
namespace {

constexpr double kLog2e = 1.4426950408889634;

struct Plan {
  int64_t fwd, pre, dkdv, dq;              // kernel indices
  int64_t fwd_x, pre_x, dkdv_x, dq_x;      // each grid's first dimension (the second is B*H)
};

Registry<Plan>& plans() { return registry<Plan>(); }

int64_t add_plan(int64_t fwd, int64_t pre, int64_t dkdv, int64_t dq, int64_t fwd_x, int64_t pre_x, int64_t dkdv_x,
                 int64_t dq_x) {
  return plans().add(Plan{fwd, pre, dkdv, dq, fwd_x, pre_x, dkdv_x, dq_x});
}

struct AttentionFn : public torch::autograd::Function<AttentionFn> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               double scale, int64_t plan, int64_t stream) {
    RECORD_FUNCTION("perfloop::flash_attention", std::vector<c10::IValue>({q, k, v}));
    c10::DeviceGuard on_device(q.device());
    ensure_context(q.device().index());
    const Plan& p = plans().at(plan);
    const int64_t b = q.size(0), h = q.size(1), sq = q.size(2), d = q.size(3), sk = k.size(2);
    at::Tensor o = at::empty({b, h, sq, d}, q.options());
    at::Tensor lse = at::empty({b, h, sq}, q.options().dtype(at::kFloat));
    launch(kernels().at(p.fwd), static_cast<unsigned>(p.fwd_x), static_cast<unsigned>(b * h), 1,
           reinterpret_cast<void*>(stream),
           {q, k, v, o, lse, scale * kLog2e,
            q.stride(0), q.stride(1), q.stride(2), q.stride(3), k.stride(0), k.stride(1), k.stride(2), k.stride(3),
            v.stride(0), v.stride(1), v.stride(2), v.stride(3), o.stride(0), o.stride(1), o.stride(2), o.stride(3),
            h, sq, sk, sk, 0, 0, 0, 0, 0, 0, 0, 0, 0});  // V's rows: sk; the nine constexprs: compiled in
    ctx->save_for_backward({q, k, v, o, lse});
    ctx->mark_non_differentiable({lse});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["plan"] = plan;
    ctx->saved_data["stream"] = stream;
    return {o, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    RECORD_FUNCTION("perfloop::flash_attention_backward", std::vector<c10::IValue>({grads[0]}));
    const auto saved = ctx->get_saved_variables();
    const at::Tensor q = packed(saved[0]), k = packed(saved[1]), v = packed(saved[2]), o = packed(saved[3]);
    const at::Tensor& lse = saved[4];
    c10::DeviceGuard on_device(q.device());
    ensure_context(q.device().index());
    const Plan& p = plans().at(ctx->saved_data["plan"].toInt());
    void* s = reinterpret_cast<void*>(ctx->saved_data["stream"].toInt());
    const double scale = ctx->saved_data["scale"].toDouble();
    const at::Tensor dout = packed(grads[0]);
    const int64_t bh = q.size(0) * q.size(1), h = q.size(1), sq = q.size(2), sk = k.size(2);
    at::Tensor dl = at::empty_like(lse);
    launch(kernels().at(p.pre), static_cast<unsigned>(p.pre_x), static_cast<unsigned>(bh), 1, s,
           {o, dout, dl, sq, 0, 0, 0});
    at::Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
    launch(kernels().at(p.dkdv), static_cast<unsigned>(p.dkdv_x), static_cast<unsigned>(bh), 1, s,
           {q, k, v, dout, lse, dl, dk, dv, scale, h, sq, sk, 0, 0, 0, 0, 0, 0, 0, 0, 0});
    launch(kernels().at(p.dq), static_cast<unsigned>(p.dq_x), static_cast<unsigned>(bh), 1, s,
           {q, k, v, dout, lse, dl, dq, scale, h, sq, sk, 0, 0, 0, 0, 0, 0, 0, 0, 0});
    return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

variable_list attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, int64_t plan,
                        int64_t stream) {
  return AttentionFn::apply(q, k, v, scale, plan, stream);
}

}  // namespace
}  // namespace perfloop

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_kernel", &perfloop::add_kernel);
  m.def("add_plan", &perfloop::add_plan);
  m.def("attention", &perfloop::attention, "(out, lse) with the backward in C++ (q, k, v, scale, plan, stream)");
}
