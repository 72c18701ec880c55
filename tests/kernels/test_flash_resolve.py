"""Which backend runs a kind of call (``kernels.flash.resolve_flash``): "auto"'s preferences
as set from the H200 figures (bench/results/NVIDIA_H200.json: our Triton kernels beat FA2 on
sm90, so FA is taken there only as FA3 / FA4), and "flash" / "fa4" giving way where they
cannot run a call. The GPU, its capability, torch's active flash implementation and the
flash-attn-4 package are stood in for, so every branch runs on a CPU."""

from __future__ import annotations

import types

import pytest
import torch

from varlen_cp.kernels import flash

CUDA, CPU = torch.device("cuda"), torch.device("cpu")
BF16 = torch.bfloat16


@pytest.fixture
def gpu(monkeypatch):
    """A stand-in GPU: set ``.cap`` (capability), ``.impl`` (torch's active flash
    implementation), ``.fa4`` (flash-attn-4 installed); torch's flash ops have a kernel."""
    state = types.SimpleNamespace(cap=(9, 0), impl=None, fa4=False)
    monkeypatch.setattr(flash, "capability", lambda device: state.cap)
    monkeypatch.setattr(flash, "active_flash_impl", lambda: state.impl)
    monkeypatch.setattr(flash, "fa4_interface", lambda: object() if state.fa4 else None)
    real = flash.has_flash_kernel
    monkeypatch.setattr(flash, "has_flash_kernel",
                        lambda device: device.type == "cuda" or real(device))
    return state


def resolve(backend, device=CUDA, dtype=BF16, d=128, dv=128, lse_grad=False, row_max=False):
    return flash.resolve_flash(backend, device, dtype, d, dv, lse_grad, row_max)


@pytest.mark.parametrize("cap, impl, fa4, want", [
    ((9, 0), None, False, None),      # FA2 on Hopper: our Triton kernels are faster
    ((10, 0), None, False, None),     # and from sm90 on
    ((8, 0), None, False, "flash"),   # FA2 on Ampere: the field's kernel, ours untimed
    ((9, 0), "FA3", False, "flash"),  # activated FA3 / FA4: torch's flash ops
    ((10, 0), "FA4", False, "flash"),
    ((9, 0), None, True, "fa4"),      # flash-attn-4 installed: first choice
    ((9, 0), "FA3", True, "fa4"),
    ((8, 0), None, True, "flash"),    # FA4's backward needs sm90: FA2 on Ampere
])
def test_auto_preferences(gpu, cap, impl, fa4, want):
    gpu.cap, gpu.impl, gpu.fa4 = cap, impl, fa4
    got, why = resolve("auto")
    assert got == want, why
    if want is None:
        assert "FA2" in why and "sm" in why


def test_auto_gives_way_per_kind_of_call(gpu):
    gpu.impl = "FA3"
    assert resolve("auto", lse_grad=True) == (None, flash.unsupported(
        "flash", CUDA, BF16, 128, 128, True))                  # FA3 drops the LSE gradient
    gpu.fa4 = True
    assert resolve("auto", lse_grad=True)[0] == "fa4"          # FA4 takes it
    got, why = resolve("auto", row_max=True)                    # nobody gives the row max
    assert got is None and "row max" in why
    got, why = resolve("auto", dtype=torch.float32)
    assert got is None and "float32" in why
    assert resolve("auto", device=CPU) == (None, "backend 'auto' on a CPU runs the PyTorch twin")


def test_explicit_backends_are_honoured(gpu):
    """A user's "flash" runs FA2 even where auto would not (their choice); each backend's
    limits still send calls it cannot run to our kernels, with the reason."""
    assert resolve("flash") == ("flash", None)
    got, why = resolve("flash", d=192, dv=128)
    assert got is None and "192/128" in why
    with pytest.raises(ValueError, match="flash-attn-4"):
        resolve("fa4")
    gpu.fa4 = True
    assert resolve("fa4") == ("fa4", None)
    gpu.cap = (8, 0)
    got, why = resolve("fa4")
    assert got is None and "sm8" in why
    for ours in ("triton", "torch"):
        assert resolve(ours)[0] is None


def test_flash_on_a_cpu_needs_a_registered_kernel():
    from tests import flash_emulator as fe

    was = fe.is_registered()
    if was:
        fe.unregister()
    try:
        with pytest.raises(ValueError, match="backend='flash' on cpu"):
            resolve("flash", device=CPU)
        fe.register()
        assert resolve("flash", device=CPU) == ("flash", None)
    finally:
        if not was and fe.is_registered():
            fe.unregister()
        elif was and not fe.is_registered():
            fe.register()


def test_active_flash_impl_reads_torch_registry(monkeypatch):
    from torch.nn import attention

    monkeypatch.setattr(attention, "current_flash_attention_impl", lambda: "FA3",
                        raising=False)
    assert flash.active_flash_impl() == "FA3"
    monkeypatch.delattr(attention, "current_flash_attention_impl")
    assert flash.active_flash_impl() is None   # a torch without the registry: FA2


@pytest.mark.skipif(torch.cuda.is_available(), reason="a host without CUDA")
def test_capability_without_cuda_is_unknown():
    """Tables planned for a CUDA device on a host without CUDA (the tests' stand-in device)
    do not ask the driver: the capability is (0, 0), and auto keeps its pre-sm90 choice."""
    assert flash.capability(CUDA) == (0, 0)
