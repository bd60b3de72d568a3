// Launching compiled Triton kernels from C++: a fused op's autograd Function written here runs
// its forward and backward with no Python on the path (the backward runs inside autograd's C++
// engine, as torch's own ops do). Python compiles each kernel through Triton, then hands over
// its CUfunction and how its parameters are passed (perfloop/ops/native.py): per argument of
// the kernel's Python signature one letter -- 'p' a pointer, 'i' a 32-bit and 'l' a 64-bit
// integer, 'f' a 32-bit float, '-' not passed (a constexpr, or an integer Triton specialized
// into one) -- and how many null pointers Triton appends (its scratch buffers, unused here).
//
// Only libc10/libtorch are linked: cuLaunchKernel is found in the driver torch has loaded,
// and the stream is the one Python passed in (the forward's; autograd runs a backward on its
// forward's stream), so this builds with a CPU-only torch too.
//
// Each Function records its forward and its backward as profiler ops, "perfloop::<op>" and
// "perfloop::<op>_backward" (nn/compiled.py's custom ops' names where the op has one): a
// profile charges the kernels they launch to the fused op.
#pragma once

#include <ATen/record_function.h>
#include <dlfcn.h>
#include <torch/extension.h>

#include <array>
#include <cstring>
#include <deque>
#include <initializer_list>
#include <mutex>
#include <string>
#include <vector>

namespace perfloop {

using CuLaunch = int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*,
                         void**, void**);
using CuCtxGetCurrent = int (*)(void**);
using CuCtxSetCurrent = int (*)(void*);
using CuDeviceGet = int (*)(int*, int);
using CuPrimaryCtxRetain = int (*)(void**, int);

struct Driver {
  CuLaunch launch;
  CuCtxGetCurrent ctx_get;
  CuCtxSetCurrent ctx_set;
  CuDeviceGet device_get;
  CuPrimaryCtxRetain primary_retain;
};

inline void* driver_symbol(void* lib, const char* name) {
  void* f = dlsym(lib, name);
  TORCH_CHECK(f != nullptr, "perfloop native launch: libcuda.so.1 has no ", name);
  return f;
}

inline const Driver& driver() {
  static const Driver d = [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW);
    TORCH_CHECK(lib != nullptr, "perfloop native launch: cannot open libcuda.so.1 (no CUDA driver)");
    return Driver{reinterpret_cast<CuLaunch>(driver_symbol(lib, "cuLaunchKernel")),
                  reinterpret_cast<CuCtxGetCurrent>(driver_symbol(lib, "cuCtxGetCurrent")),
                  reinterpret_cast<CuCtxSetCurrent>(driver_symbol(lib, "cuCtxSetCurrent")),
                  reinterpret_cast<CuDeviceGet>(driver_symbol(lib, "cuDeviceGet")),
                  reinterpret_cast<CuPrimaryCtxRetain>(driver_symbol(lib, "cuDevicePrimaryCtxRetain"))};
  }();
  return d;
}

// A thread that has not yet made a CUDA runtime call (autograd's device thread, whose
// allocations come from torch's cache) has no current context: make the device's primary
// context current, as Triton's own launcher does.
inline void ensure_context(int device) {
  const Driver& d = driver();
  void* ctx = nullptr;
  TORCH_CHECK(d.ctx_get(&ctx) == 0, "perfloop native launch: cuCtxGetCurrent failed");
  if (ctx != nullptr) return;
  int dev = 0;
  TORCH_CHECK(d.device_get(&dev, device) == 0, "perfloop native launch: cuDeviceGet failed");
  TORCH_CHECK(d.primary_retain(&ctx, dev) == 0 && d.ctx_set(ctx) == 0,
              "perfloop native launch: cannot make device ", device, "'s context current");
}

struct Kernel {
  void* function = nullptr;  // CUfunction, loaded by Triton (kept alive by the Python side)
  unsigned threads = 0;
  unsigned shared = 0;
  std::string params;
  int trailing_nulls = 0;
};

struct Arg {  // one argument of a kernel's Python signature, as the C++ caller has it
  enum Kind { Int, Float, Ptr } kind;
  int64_t i = 0;
  double f = 0.0;
  const void* p = nullptr;
  Arg(int64_t v) : kind(Int), i(v) {}
  Arg(int v) : kind(Int), i(v) {}
  Arg(double v) : kind(Float), f(v) {}
  Arg(const at::Tensor& t) : kind(Ptr), p(t.data_ptr()) {}
};

constexpr int kMaxParams = 40;

// The kernel's parameter values, packed the way cuLaunchKernel takes them: 8-byte slots, a
// 32-bit value in the low bytes of its slot. Returns how many slots are used.
inline int pack(const Kernel& k, const Arg* args, size_t count, std::array<uint64_t, kMaxParams>& slots) {
  TORCH_CHECK(count == k.params.size(), "perfloop native launch: ", count, " arguments for a kernel of ",
              k.params.size());
  int n = 0;
  for (size_t j = 0; j < count; ++j) {
    const Arg& a = args[j];
    const char c = k.params[j];
    if (c == '-') continue;
    TORCH_CHECK(n < kMaxParams, "perfloop native launch: too many parameters");
    uint64_t slot = 0;
    if (c == 'p') {
      TORCH_CHECK(a.kind == Arg::Ptr, "perfloop native launch: argument ", j, " is not a tensor");
      slot = reinterpret_cast<uint64_t>(a.p);
    } else if (c == 'i') {
      TORCH_CHECK(a.kind == Arg::Int, "perfloop native launch: argument ", j, " is not an integer");
      const int32_t v = static_cast<int32_t>(a.i);
      std::memcpy(&slot, &v, sizeof v);
    } else if (c == 'l') {
      TORCH_CHECK(a.kind == Arg::Int, "perfloop native launch: argument ", j, " is not an integer");
      slot = static_cast<uint64_t>(a.i);
    } else if (c == 'f') {
      TORCH_CHECK(a.kind == Arg::Float, "perfloop native launch: argument ", j, " is not a float");
      const float v = static_cast<float>(a.f);
      std::memcpy(&slot, &v, sizeof v);
    } else {
      TORCH_CHECK(false, "perfloop native launch: unknown parameter kind '", c, "'");
    }
    slots[n++] = slot;
  }
  for (int t = 0; t < k.trailing_nulls; ++t) {
    TORCH_CHECK(n < kMaxParams, "perfloop native launch: too many parameters");
    slots[n++] = 0;
  }
  return n;
}

inline void launch(const Kernel& k, unsigned gx, unsigned gy, unsigned gz, void* stream,
                   std::initializer_list<Arg> args) {
  std::array<uint64_t, kMaxParams> slots{};
  std::array<void*, kMaxParams> ptrs{};
  const int n = pack(k, args.begin(), args.size(), slots);
  for (int i = 0; i < n; ++i) ptrs[i] = &slots[i];
  const int rc = driver().launch(k.function, gx, gy, gz, k.threads, 1, 1, k.shared, stream, ptrs.data(), nullptr);
  TORCH_CHECK(rc == 0, "perfloop native launch: cuLaunchKernel returned CUDA error ", rc);
}

// A tensor the kernels may take as compiled: contiguous, 16-byte aligned (what Triton assumed
// of the tensors the kernels were compiled with).
inline at::Tensor packed(const at::Tensor& t) {
  if (!t.is_contiguous()) return t.contiguous();  // a new allocation: aligned
  if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0) return t;
  return t.clone(at::MemoryFormat::Contiguous);
}

// What Python hands over (kernels, an op's plans), indexed in the order added. A deque keeps
// every element where it is as others are added; the lock keeps autograd's thread, reading in
// a backward, apart from a forward on another thread adding a plan for a new shape.
template <typename T>
class Registry {
 public:
  int64_t add(T item) {
    std::lock_guard<std::mutex> lock(mutex_);
    items_.push_back(std::move(item));
    return static_cast<int64_t>(items_.size()) - 1;
  }
  const T& at(int64_t i) {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(i >= 0 && i < static_cast<int64_t>(items_.size()), "perfloop native: no entry ", i);
    return items_[static_cast<size_t>(i)];
  }

 private:
  std::mutex mutex_;
  std::deque<T> items_;
};

// One registry per type in each extension: its kernels, and its op's plans.
template <typename T>
inline Registry<T>& registry() {
  static Registry<T> all;
  return all;
}

inline Registry<Kernel>& kernels() { return registry<Kernel>(); }

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

inline int64_t add_kernel(int64_t function, int64_t threads, int64_t shared, const std::string& params,
                          int64_t trailing_nulls) {
  return kernels().add(Kernel{reinterpret_cast<void*>(function), static_cast<unsigned>(threads),
                              static_cast<unsigned>(shared), params, static_cast<int>(trailing_nulls)});
}

// What pack() makes of integer and float arguments, for a test on a machine with no GPU.
inline std::vector<int64_t> pack_for_test(const std::string& params, int64_t trailing_nulls,
                                          const std::vector<double>& values) {
  Kernel k{nullptr, 0, 0, params, static_cast<int>(trailing_nulls)};
  std::vector<Arg> args;
  for (size_t i = 0; i < values.size(); ++i) {
    if (i < params.size() && params[i] == 'f') args.emplace_back(values[i]);
    else args.emplace_back(static_cast<int64_t>(values[i]));
  }
  std::array<uint64_t, kMaxParams> slots{};
  const int n = pack(k, args.data(), args.size(), slots);
  return std::vector<int64_t>(slots.begin(), slots.begin() + n);
}

}  // namespace perfloop
