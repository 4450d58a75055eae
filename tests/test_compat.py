"""The one door to private torch and DeepSpeed internals (lab.runtime.compat): present where tested, and a
missing one fails in one line that names it."""

import types

import pytest

from lab.runtime import compat


def test_every_torch_internal_the_lab_uses_is_in_the_installed_torch():
    assert all(compat.torch_internals().values()), compat.torch_internals()
    compat.check()


@pytest.mark.parametrize("stage", [1, 3])
def test_a_deepspeed_optimizer_without_a_field_the_lab_reads_fails_in_one_line(stage):
    fields = compat.DEEPSPEED_OPTIMIZER_FIELDS[stage]
    complete = types.SimpleNamespace(**dict.fromkeys(fields))
    compat.check_deepspeed_optimizer(complete, stage)
    lacking = types.SimpleNamespace(**dict.fromkeys(fields[1:]))
    with pytest.raises(compat.Incompatible) as e:
        compat.check_deepspeed_optimizer(lacking, stage)
    assert f"SimpleNamespace.{fields[0]}" in str(e.value) and "\n" not in str(e.value)


def test_ddp_turns_off_the_buffer_sync_with_the_keyword_the_installed_torch_has(monkeypatch):
    """torch 2.13 renamed broadcast_buffers to forward_sync_buffers; an older torch has only the old name (an H100
    machine's torch 2.11 refused the new one)."""
    assert compat.ddp_without_buffer_sync() == {"forward_sync_buffers": False}  # the pinned torch

    class OlderDDP:
        def __init__(self, module, device_ids=None, broadcast_buffers=True, process_group=None):
            pass

    monkeypatch.setattr(compat, "DistributedDataParallel", OlderDDP)
    assert compat.ddp_without_buffer_sync() == {"broadcast_buffers": False}
