"""How gc --compress stores one tensor: grouped and compressed, or a delta on its keyframe only when
the delta is worth a load reading and decoding the keyframe too; raw when neither saves enough."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptstore.service.format import encoding
from ckptstore.service.reclaim import encoding_choice
from ckptstore.service.reclaim.encoding_choice import DELTA_AT_MOST, MIN_GAIN, choose, samples

BASE_DIGEST = "ab" * 32


def weights(seed: int, count: int = 1 << 16) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(count) * 0.02).astype(np.float32)


def moved(values: np.ndarray, scale: float, seed: int = 1) -> np.ndarray:
    """``values`` after a step of relative size ``scale``: small steps leave most high bits alone."""
    step = np.random.default_rng(seed).standard_normal(values.size).astype(np.float32) * scale
    return (values * (1 + step)).astype(np.float32)


def sizes(data: np.ndarray, base: np.ndarray) -> tuple[int, int]:
    """What the choice compares: the samples compressed whole, and as deltas."""
    raw, under = memoryview(data.tobytes()), memoryview(base.tobytes())
    whole = sum(len(encoding.encode(raw[part], 4)) for part in samples(len(raw)))
    delta = sum(
        len(encoding.encode(raw[part], 4, base=under[part], base_digest=BASE_DIGEST)) for part in samples(len(raw))
    )
    return whole, delta


@settings(max_examples=12, deadline=None)
@given(st.floats(1e-7, 1e-1), st.integers(0, 1000))
def test_a_delta_is_stored_exactly_when_it_takes_at_most_its_share_of_the_whole(scale: float, seed: int) -> None:
    base = weights(seed)
    data = moved(base, scale, seed + 1)
    whole, delta = sizes(data, base)
    chosen = choose(memoryview(data.tobytes()), 4, memoryview(base.tobytes()), BASE_DIGEST)
    assert chosen is not None  # 0.02-scale normals always compress by more than MIN_GAIN
    name, parts = chosen
    payload = b"".join(parts)
    assert name == ("diff-grouped-zstd" if delta <= DELTA_AT_MOST * whole else "grouped-zstd")
    assert len(payload) <= (1 - MIN_GAIN) * data.nbytes
    out = bytearray(data.nbytes)
    head = encoding.parse_head(payload, nbytes=data.nbytes, width=4, subject="t")
    chain = [(head, payload)]
    if name == "diff-grouped-zstd":
        out[:] = base.tobytes()
    encoding.decode_chain(chain, memoryview(out), subject="t")
    assert bytes(out) == data.tobytes()


def test_the_share_decides_between_two_encodings_that_both_save(monkeypatch: pytest.MonkeyPatch) -> None:
    base = weights(0)
    data = moved(base, 1e-3)
    whole, delta = sizes(data, base)
    assert 0.5 * whole < delta < whole  # a delta that saves, but not much: fp32 weights a few steps on

    def chosen(share: float) -> str:
        monkeypatch.setattr(encoding_choice, "DELTA_AT_MOST", share)
        found = choose(memoryview(data.tobytes()), 4, memoryview(base.tobytes()), BASE_DIGEST)
        assert found is not None
        return found[0]

    assert chosen(delta / whole + 0.01) == "diff-grouped-zstd"
    assert chosen(delta / whole - 0.01) == "grouped-zstd"


def test_bytes_that_do_not_compress_stay_raw() -> None:
    noise = np.random.default_rng(0).integers(0, 256, 1 << 18, dtype=np.uint8)
    assert choose(memoryview(noise.tobytes()), 1, None, None) is None
    other = np.random.default_rng(1).integers(0, 256, 1 << 18, dtype=np.uint8)
    assert choose(memoryview(noise.tobytes()), 1, memoryview(other.tobytes()), BASE_DIGEST) is None


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 1 << 34))
def test_samples_are_a_bounded_share_spread_over_the_tensor(nbytes: int) -> None:
    """The choice compresses at most an eighth of a large tensor both ways (no fixed size that
    costs more than compressing a small one), in equal, element-aligned stretches that stay
    inside it and do not overlap."""
    parts = samples(nbytes)
    sizes = {part.stop - part.start for part in parts}
    assert len(sizes) == 1 and len(parts) in (1, encoding_choice.SAMPLES)
    size = sizes.pop()
    assert all(part.start % 8 == 0 and 0 <= part.start < part.stop <= nbytes for part in parts)
    assert all(a.stop <= b.start for a, b in zip(parts, parts[1:], strict=False))
    floor = encoding_choice.SAMPLES * encoding_choice.SAMPLE_MIN_BYTES
    if len(parts) == 1:  # a short tensor: all of it
        assert parts[0] == slice(0, nbytes) and nbytes <= floor
    else:
        assert size % 8 == 0 and encoding_choice.SAMPLE_MIN_BYTES <= size <= encoding_choice.SAMPLE_BYTES
        assert len(parts) * size <= max(nbytes * encoding_choice.SAMPLED_SHARE, floor)
