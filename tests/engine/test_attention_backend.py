"""Which attention kernels the process runs (engine/lease_thread.py), and that nothing changes on the CPU."""

from __future__ import annotations

import os
from collections.abc import Iterator

import mlx.core as mx
import pytest

from mlx_trio.engine import lease_thread
from mlx_trio.engine.kv import decode_layout
from mlx_trio.engine.lease_thread import (
    ATTENTION_BACKEND_ENV, CUDNN, CUDNN_ATTENTION_ENV, CUDNN_PLAN_CACHE_ENV, CUDNN_PREFILL, DEFAULT_CUDA_BACKEND,
    MLX_KERNELS, SET_BY_LEASE_ENV, attention_backend, forget_inherited,
)


@pytest.mark.parametrize("named", ["", "mlx", "cudnn", "cudnn-prefill", "CUDNN-Prefill "])
@pytest.mark.parametrize("mlx_setting", [None, "0", "1"])
def test_off_cuda_every_setting_is_mlx_kernels(named: str, mlx_setting: str | None) -> None:
    env = {ATTENTION_BACKEND_ENV: named} | ({CUDNN_ATTENTION_ENV: mlx_setting} if mlx_setting else {})
    assert attention_backend(env, cuda=False) == MLX_KERNELS
    assert attention_backend(env, cuda=False, speculates=True) == MLX_KERNELS


def test_on_cuda_the_named_backend_unless_mlx_own_variable_is_set() -> None:
    assert attention_backend({}, cuda=True) == DEFAULT_CUDA_BACKEND
    assert attention_backend({ATTENTION_BACKEND_ENV: "cudnn-prefill"}, cuda=True) == CUDNN_PREFILL
    assert attention_backend({ATTENTION_BACKEND_ENV: " CUDNN "}, cuda=True) == CUDNN
    assert attention_backend({ATTENTION_BACKEND_ENV: "mlx"}, cuda=True) == MLX_KERNELS
    # MLX's own variable, set by the user, wins as it always did.
    assert attention_backend({ATTENTION_BACKEND_ENV: "cudnn-prefill", CUDNN_ATTENTION_ENV: "0"}, cuda=True) == MLX_KERNELS
    assert attention_backend({ATTENTION_BACKEND_ENV: "cudnn-prefill", CUDNN_ATTENTION_ENV: "1"}, cuda=True) == CUDNN
    assert attention_backend({ATTENTION_BACKEND_ENV: "mlx", CUDNN_ATTENTION_ENV: " "}, cuda=True) == MLX_KERNELS


def test_speculation_keeps_prefill_only_cudnn_off() -> None:
    """Verify steps are short queries at a new key length each step: cuDNN would plan every one afresh."""
    assert attention_backend({ATTENTION_BACKEND_ENV: "cudnn-prefill"}, cuda=True, speculates=True) == MLX_KERNELS
    assert attention_backend({ATTENTION_BACKEND_ENV: "cudnn"}, cuda=True, speculates=True) == CUDNN


def test_the_cuda_default_is_one_constant_and_speculation_still_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Switching the default to prefill-only cuDNN (after a device run) is `DEFAULT_CUDA_BACKEND` alone."""
    monkeypatch.setattr(lease_thread, "DEFAULT_CUDA_BACKEND", CUDNN_PREFILL)
    assert attention_backend({}, cuda=True) == CUDNN_PREFILL
    assert attention_backend({}, cuda=True, speculates=True) == MLX_KERNELS
    assert attention_backend({ATTENTION_BACKEND_ENV: "mlx"}, cuda=True) == MLX_KERNELS
    assert attention_backend({CUDNN_ATTENTION_ENV: "0"}, cuda=True) == MLX_KERNELS
    assert attention_backend({}, cuda=False) == MLX_KERNELS


def test_an_unknown_backend_is_refused_everywhere() -> None:
    for cuda in (False, True):
        with pytest.raises(ValueError, match="flash"):
            attention_backend({ATTENTION_BACKEND_ENV: "flash"}, cuda=cuda)


@pytest.fixture
def fresh_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """prepare_thread as in a new process: nothing chosen yet; restored afterwards."""
    monkeypatch.setattr(lease_thread, "_chosen", None)
    for name in (ATTENTION_BACKEND_ENV, CUDNN_ATTENTION_ENV, CUDNN_PLAN_CACHE_ENV, SET_BY_LEASE_ENV):
        monkeypatch.setenv(name, "")  # recorded, so that what prepare_thread sets is undone too
        monkeypatch.delenv(name)
    active = decode_layout.is_active()
    yield
    decode_layout.set_active(active)


def test_on_this_cpu_prefill_only_cudnn_changes_nothing(fresh_process: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Asked for on the CPU: MLX's kernels (the variable as before), and decode's layout stays off."""
    assert not lease_thread.on_cuda()
    monkeypatch.setenv(ATTENTION_BACKEND_ENV, "cudnn-prefill")
    lease_thread.prepare_thread()
    assert lease_thread.chosen_backend() == MLX_KERNELS
    assert os.environ[CUDNN_ATTENTION_ENV] == "0"
    assert not decode_layout.is_active()


def test_the_first_choice_holds_for_the_process(fresh_process: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """MLX reads its variable once: a restarted lease keeps the first thread's backend."""
    monkeypatch.setattr(lease_thread, "on_cuda", lambda: True)
    monkeypatch.setenv(ATTENTION_BACKEND_ENV, "cudnn-prefill")
    lease_thread.prepare_thread()
    assert lease_thread.chosen_backend() == CUDNN_PREFILL and os.environ[CUDNN_ATTENTION_ENV] == "1"
    assert decode_layout.is_active()
    monkeypatch.setenv(ATTENTION_BACKEND_ENV, "mlx")  # too late: MLX has read its variable
    lease_thread.prepare_thread()
    assert lease_thread.chosen_backend() == CUDNN_PREFILL and decode_layout.is_active()


def test_a_child_chooses_afresh_what_its_parents_lease_set(fresh_process: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process started after an engine opened (a benchmark's server) inherits MLX's variables that the
    engine's lease set for itself: they must not read as the user's choice of cuDNN everywhere."""
    monkeypatch.setattr(lease_thread, "on_cuda", lambda: True)
    lease_thread.prepare_thread()  # the parent's lease
    assert lease_thread.chosen_backend() == DEFAULT_CUDA_BACKEND == CUDNN_PREFILL
    assert os.environ[CUDNN_ATTENTION_ENV] == "1"
    assert set(os.environ[SET_BY_LEASE_ENV].split(",")) == {CUDNN_ATTENTION_ENV, CUDNN_PLAN_CACHE_ENV}
    assert attention_backend(os.environ, cuda=True) == CUDNN  # what a child read before: cuDNN decode
    monkeypatch.setattr(lease_thread, "_chosen", None)  # the child, with the inherited environment
    decode_layout.set_active(False)
    lease_thread.prepare_thread()
    assert lease_thread.chosen_backend() == CUDNN_PREFILL and decode_layout.is_active()


def test_what_the_user_set_is_never_forgotten() -> None:
    env = {CUDNN_ATTENTION_ENV: "0", CUDNN_PLAN_CACHE_ENV: "2048", SET_BY_LEASE_ENV: CUDNN_PLAN_CACHE_ENV, "PATH": "/bin"}
    forget_inherited(env)
    assert env == {CUDNN_ATTENTION_ENV: "0", "PATH": "/bin"}
    assert attention_backend(env, cuda=True) == MLX_KERNELS
    forget_inherited(env)  # nothing listed: nothing goes
    assert env == {CUDNN_ATTENTION_ENV: "0", "PATH": "/bin"}
