"""A swap checked on the model's own activations: the original module, its replacement and a
float64 run of the original, forward and backward on recorded inputs, each output and gradient
within the op's tolerances (or twice the original's own error in its dtype, where larger)."""

from __future__ import annotations

import contextlib
import copy
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from perfloop.nn import head as _head
from perfloop.nn import modules as _modules
from perfloop.nn import rewrite as _rewrite


@dataclass
class Swap:
    name: str  # qualified name in the model
    kind: str  # the original's class
    replaced: bool
    reason: str = ""  # why not, when not
    errors: dict = field(default_factory=dict)  # tensor -> (fused error, original's error), normalized
    aliases: list = field(default_factory=list)  # the other names the same module goes by
    site: tuple | None = None  # a functional call: (module's name, function, source line)
    via: str = ""  # a rewritten pattern: where, and what it became
    options: dict = field(default_factory=dict)  # attributes the check set on the fused module
    rewritten: bool = False  # a forward rewritten in place (nn.rewrite), not a module swapped


def first_device(args, kwargs) -> str:
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    return tensors[0].device.type if tensors else "cpu"


def recorded(args, kwargs) -> tuple:
    """(args, kwargs, autocast dtype or None) of a call, its tensors copied (in its tuples,
    lists and dicts too), the state of the other objects it was given (a KV cache) as it was."""
    keep = lambda a: a.detach().clone()
    dev = first_device(args, kwargs)
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
    return tuple(tree_map(keep, a) for a in args), {k: tree_map(keep, v) for k, v in kwargs.items()}, dtype


def tree_map(fn, a):
    """`a` with fn applied to each tensor in it, its tuples, lists and dicts rebuilt; any other
    object of the model's (a Hugging Face Cache, which each forward appends to) a copy of its state."""
    if isinstance(a, torch.Tensor):
        return fn(a)
    if isinstance(a, tuple) and hasattr(a, "_fields"):  # a namedtuple
        return type(a)(*(tree_map(fn, x) for x in a))
    if type(a) in (tuple, list):
        return type(a)(tree_map(fn, x) for x in a)
    if type(a) is dict:
        return {k: tree_map(fn, v) for k, v in a.items()}
    return state_copy(a)


def state_copy(a, depth: int = 3):
    """A copy of an object a forward may change (a cache), `depth` levels of its attributes,
    lists and dicts copied, the tensors in it shared (a cache rebinds them: `keys = cat(...)`),
    so that each checked run starts from the state the recorded call saw. Torch's and Python's
    own objects (modules, dtypes, numbers) are themselves."""
    if isinstance(a, list) and depth:
        return [state_copy(x, depth - 1) for x in a]
    if isinstance(a, dict) and type(a) is dict and depth:
        return {k: state_copy(v, depth - 1) for k, v in a.items()}
    own = type(a).__module__.split(".")[0] not in ("builtins", "torch", "enum", "types", "functools")
    if not (depth and own and hasattr(a, "__dict__")) or isinstance(a, nn.Module) or callable(a):
        return a
    try:
        out = copy.copy(a)
        out.__dict__.update({k: state_copy(v, depth - 1) for k, v in vars(a).items()})
    except Exception:  # an object that cannot be copied: given as it is
        return a
    return out


def copy_module(model: nn.Module) -> nn.Module:
    """A deep copy of the model; a tensor with a graph that a module keeps (a last loss) copied
    without its graph (deepcopy refuses those)."""
    memo = {
        id(v): v.detach().clone()
        for m in model.modules()
        for v in vars(m).values()
        if isinstance(v, torch.Tensor) and not v.is_leaf
    }
    return copy.deepcopy(model, memo)


def forward_backward(module, args, kwargs, autocast_dtype, seed: int, frozen=(), keep=None):
    """({leaf index: output}, {tensor name: gradient}) of module(*args, **kwargs) and one backward
    with a seeded dy for each floating output leaf (`keep`: those leaves only; the leaf's index
    seeds its dy); the tensors forward sets on the module (a last loss) count as outputs after
    those it returns; every floating input takes a gradient but those `frozen` names ("input 1")."""

    def fresh(name, a):
        if not isinstance(a, torch.Tensor):  # tensors inside tuples (a rotary's cos and sin) are not learned
            return tree_map(lambda t: t.detach().clone(), a)
        return a.detach().clone().requires_grad_(a.is_floating_point() and f"input {name}" not in frozen)

    args = [fresh(i, a) for i, a in enumerate(args)]
    kwargs = {k: fresh(k, v) for k, v in kwargs.items()}
    for p in module.parameters():
        p.grad = None
    dev = first_device(args, kwargs)
    ctx = torch.autocast(dev, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
    before = {k: v for k, v in vars(module).items() if isinstance(v, torch.Tensor)}
    with ctx:
        out = leaves(module(*args, **kwargs))
    out += [
        v for k, v in sorted(vars(module).items()) if isinstance(v, torch.Tensor) and before.get(k) is not v
    ]
    ys = {
        i: y
        for i, y in enumerate(out)
        if isinstance(y, torch.Tensor) and y.is_floating_point() and (keep is None or i in keep)
    }
    if not ys:
        raise ValueError("the module gives no floating tensor")
    pairs = []
    for i, y in ys.items():
        g = torch.Generator(device=y.device).manual_seed(seed + 7919 * i)
        dy = torch.randn(y.shape, generator=g, device=y.device, dtype=torch.float32).to(y.dtype)
        if y.requires_grad:
            pairs.append((y, dy))
    if pairs:
        torch.autograd.backward([y for y, _ in pairs], [dy for _, dy in pairs])
    inputs = [(f"input {i}", a) for i, a in enumerate(args)] + [(f"input {k}", v) for k, v in kwargs.items()]
    grads = {n: a.grad for n, a in inputs if isinstance(a, torch.Tensor) and a.grad is not None}
    grads.update({n: p.grad for n, p in module.named_parameters() if p.grad is not None})
    return {i: y.detach() for i, y in ys.items()}, grads


def leaves(out) -> list:
    """The leaves of a module's output (tensors and None; tuples, lists and dicts walked)."""
    if out is None or isinstance(out, torch.Tensor):
        return [out]
    items = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else ()
    return [t for item in items for t in leaves(item)]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute difference, relative to the largest reference value, in float64 on the
    reference's device (MPS has no float64: there, on the CPU). On the device, not the host: the
    copies of a Llama's activations and gradients sat under 58 of pl.patch's 92 s (run42, H100)."""
    dev = torch.device("cpu") if want.device.type == "mps" else want.device
    want = want.to(dev, torch.float64)
    diff = got.to(dev, torch.float64, copy=True).sub_(want)  # one temporary, `got` left as it was
    scale = torch.linalg.vector_norm(want, ord=float("inf")).clamp_min(1e-12)
    return float(torch.linalg.vector_norm(diff, ord=float("inf")) / scale)


HOOKS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def hookless(module: nn.Module) -> nn.Module:
    """The module (its parameters, the same objects) without the user's hooks, for the checks."""
    m = copy.copy(module)
    for h in HOOKS:
        if hasattr(m, h):
            setattr(m, h, OrderedDict())
    return m


def check(
    name: str,
    original: nn.Module,
    fused: nn.Module,
    args,
    kwargs,
    autocast_dtype,
    op_name: str,
    kind=None,
    unlearned=(),
    dropped: bool = False,
) -> Swap:
    """`dropped`: the fused module may give None where the original gives a tensor (logits a
    fused head does not keep); those outputs are not compared, nor taken into the backward."""
    from perfloop import ops

    kind = kind or type(original).__name__
    op = ops.get(op_name)
    original = hookless(original)
    try:
        with _modules.recording_fallbacks() as fallbacks:
            got_y, got_g = forward_backward(fused, args, kwargs, autocast_dtype, seed=0, frozen=unlearned)
    except Exception as exc:
        return Swap(name, kind, False, f"the fused module failed on this input: {exc}")
    keep = None if not dropped else set(got_y)
    ref = copy_module(original).double()
    dbl = lambda a: tree_map(lambda t: t.double() if t.is_floating_point() else t, a)
    try:
        with _modules.recording_fallbacks():  # fused modules already inside the original: unsaid
            dargs, dkwargs = [dbl(a) for a in args], {k: dbl(v) for k, v in kwargs.items()}
            want_y, want_g = forward_backward(ref, dargs, dkwargs, None, 0, unlearned, keep)
            orig_y, orig_g = forward_backward(original, args, kwargs, autocast_dtype, 0, unlearned, keep)
    finally:
        for p in original.parameters():
            p.grad = None
    if fallbacks:
        return Swap(
            name,
            kind,
            False,
            f"no fused kernel takes this call ({fallbacks[0]}): torch's forward would run, nothing gained",
        )
    options = {}
    if _promoted(fused, autocast_dtype, got_y, orig_y):  # the written form's pow makes its output fp32
        fused.autocast_fp32 = options["autocast_fp32"] = True
        got_y, got_g = forward_backward(fused, args, kwargs, autocast_dtype, seed=0, frozen=unlearned)
    said = lambda ys: ", ".join(f"{y.dtype} {tuple(y.shape)}" for y in ys.values())
    if [(i, y.dtype, y.shape) for i, y in got_y.items()] != [
        (i, y.dtype, y.shape) for i, y in orig_y.items()
    ]:
        return Swap(name, kind, False, f"output {said(got_y)} where the original gives {said(orig_y)}")
    tols = op.tolerances or {d: op.tolerance(d) for d in (torch.float32, torch.float16, torch.bfloat16)}
    first = next(iter(orig_y.values()))
    dtype = first.dtype if first.dtype in tols else torch.float32
    errors = {
        f"output{f' {i}' if i else ''}": (
            relative_error(got_y[i], want_y[i]),
            relative_error(orig_y[i], want_y[i]),
        )
        for i in got_y
    }
    for t in want_g:
        if t not in got_g:
            return Swap(name, kind, False, f"no gradient for {t}", errors)
        orig_err = relative_error(orig_g[t], want_g[t]) if t in orig_g else 0.0
        errors[f"grad {t}"] = (relative_error(got_g[t], want_g[t]), orig_err)
    for t, (fused_err, orig_err) in errors.items():
        atol, rtol = (tols if t.startswith("output") else op.grad_tolerances or tols)[dtype]
        limit = max(atol + rtol, 2 * orig_err)
        if not fused_err <= limit:
            why = f"{t} off by {fused_err:.3g} of its largest value (limit {limit:.3g})"
            return Swap(name, kind, False, why, errors)
    return Swap(name, kind, True, "", errors, options=options)


def _promoted(fused: nn.Module, autocast_dtype, got_y: list, orig_y: list) -> bool:
    """Whether the original gives fp32 under autocast where the fused module gives the autocast
    dtype, and the fused module can write fp32 instead."""
    return (
        getattr(fused, "autocast_fp32", None) is False
        and autocast_dtype is not None
        and len(got_y) == len(orig_y) == 1
        and next(iter(orig_y.values())).dtype == torch.float32
        and next(iter(got_y.values())).dtype == autocast_dtype
    )


@contextlib.contextmanager
def eval_mode(module: nn.Module):
    """Within: the module and its children in eval mode (dropout off); after: as they were."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def is_mask(a) -> bool:
    """A float input holding -inf or values that hide a position (an additive attention mask):
    training code does not learn it, so its gradient is not compared."""
    return isinstance(a, torch.Tensor) and a.is_floating_point() and bool((a <= _rewrite.HIDDEN).any())


def check_written(
    name: str, original: nn.Module, recorded, rerouted: list, logits: bool | None = None
) -> Swap:
    swap = _check_written(name, original, recorded, rerouted, logits)
    swap.rewritten = True
    return swap


def _check_written(name: str, original: nn.Module, recorded, rerouted: list, logits: bool | None) -> Swap:
    """A module whose forward writes attention, RoPE, GELU or a norm out: its forward captured
    and rewritten (nn.rewrite), then checked like a swap, in eval mode (dropout off: the random
    draws of SDPA and of the written-out dropout differ). With `logits` (whether they must be kept), its head
    too (nn.head); logits dropped are not compared."""
    kind = _rewrite.written_kind(_rewrite.writes(original))
    if recorded is None:
        return Swap(name, kind, False, "not called by the example batch")
    if any(m is original for m in rerouted):
        return Swap(name, kind, False, "its functional calls are rerouted to fused ones already")
    args, kwargs, autocast_dtype = recorded
    fused = copy.copy(original)
    r = _rewrite.Rewritten(fused, type(original).forward, alone=True, logits=logits)
    fused.forward = r
    masks = [f"input {i}" for i, a in enumerate(args) if is_mask(a)]
    masks += [f"input {k}" for k, a in kwargs.items() if is_mask(a)]
    try:
        with eval_mode(original):
            fused.training = False
            drop = logits is False
            swap = check(name, original, fused, args, kwargs, autocast_dtype, "attention", kind, masks, drop)
    except Exception as exc:
        return Swap(name, kind, False, f"the check could not run it: {type(exc).__name__}: {exc}")
    finally:
        _head.disallow(r.heads)
    done = [f for f in r.backend.found if f.replaced]
    sdpa = _attention_as_sdpa(original, r.backend)
    if not done:
        why = "; ".join(dict.fromkeys(f"{f.line or f.pattern}: {f.reason}" for f in r.backend.found))
        if not why and not sdpa:
            captured = "its captured graph holds none of the written forms"
            why = captured if r.backend.graphs else "Dynamo captured no graph of its forward"
        why = "; ".join(w for w in (sdpa, why) if w)
        return Swap(name, kind, False, f"nothing one fused call can take: {why}", swap.errors)
    swap.kind = _rewrite.written_kind({f.pattern for f in done})
    swap.via = "; ".join(dict.fromkeys([*(_said(f) for f in done), *([sdpa] if sdpa else [])]))
    return swap


def _attention_as_sdpa(original: nn.Module, backend) -> str:
    """Where the forward may write attention out but its captures call SDPA instead (a Hugging
    Face attention under attn_implementation="sdpa"), that said; else ""."""
    if _rewrite.ATTENTION not in _rewrite.writes(original) or not backend.sdpa:
        return ""
    if any(f.pattern == _rewrite.ATTENTION for f in backend.found):
        return ""
    return "its attention is one F.scaled_dot_product_attention call already (nothing to fuse)"


def _said(f) -> str:
    if f.pattern == _rewrite.ATTENTION:
        said = ["attn_mask"] if f.form["attn_mask"] else []
        said += [f"{k}={v}" for k, v in f.form.items() if k != "attn_mask" and v not in (False, None, 0.0)]
        return f"{f.line} -> F.scaled_dot_product_attention(q, k, v{''.join(', ' + a for a in said)})"
    if f.pattern == _rewrite.GELU:
        return f"GELU ({f.form['form']} form) -> perfloop's fused GELU"
    if f.pattern == _rewrite.NORM:
        affine = " with its weight" + (" and bias" if f.form["bias"] else "") if f.form["weight"] else ""
        fused = "RMSNorm" if f.form["form"] == "RMS" else "LayerNorm"
        return f"{f.form['form']} norm (eps {f.form['eps']:g}){affine} -> perfloop's fused {fused}"
    if f.pattern == _rewrite.LOSS:
        kept = "" if f.form["logits"] == "kept" else " (the logits returned as None)"
        return f"{f.line}: linear + F.cross_entropy -> perfloop's fused linear + cross entropy{kept}"
    pairs = "neighbouring pairs" if f.form["interleaved"] else "halves"
    return f"RoPE ({f.form['form']} form, {pairs}) -> perfloop's fused RoPE"
