"""Learning-rate schedules: warmup, cosine, WSD, constant; lengths set by the step count."""

import math

import pytest

from lab.runtime.config import ConfigError, TrainConfig
from lab.training.schedule import learning_rate, validate


def lrs(total, **kw):
    cfg = TrainConfig(lr=1.0, min_lr_ratio=0.1, **kw)
    return [learning_rate(s, total, cfg) for s in range(total)]


def test_warmup_then_cosine_reaches_the_floor_at_the_end():
    lr = lrs(100, warmup=0.1)
    assert lr[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert all(a >= b for a, b in zip(lr[10:], lr[11:]))
    assert lr[-1] == pytest.approx(0.1)
    mid = 10 + 45  # halfway through the decay: floor + (peak - floor)/2
    assert lr[mid - 1] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 45 / 90)))


def test_wsd_holds_the_peak_then_decays_linearly():
    lr = lrs(100, schedule="wsd", warmup=0.05, decay=0.2)
    assert lr[4] == pytest.approx(1.0) and lr[5:80] == pytest.approx([1.0] * 75)
    assert lr[-1] == pytest.approx(0.1)
    steps = [lr[i] - lr[i + 1] for i in range(80, 99)]
    assert steps == pytest.approx([steps[0]] * len(steps))


def test_constant_and_no_warmup():
    assert lrs(10, schedule="constant", warmup=0.0) == pytest.approx([1.0] * 10)


@pytest.mark.parametrize("kw, message", [
    (dict(schedule="linear"), "train.schedule must be one of"),
    (dict(warmup=1.2), "fractions"),
    (dict(schedule="wsd", warmup=0.5, decay=0.6), "fractions"),
    (dict(lr=0.0), "train.lr must be positive"),
])
def test_invalid_schedules(kw, message):
    with pytest.raises(ConfigError, match=message):
        validate(TrainConfig(**kw))
