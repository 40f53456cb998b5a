import matplotlib.image as mpimg
import numpy as np
import pytest
from matplotlib.colors import to_rgb

from parallel.pipeline.schedules import Forward, interleaved_1f1b, one_f_one_b
from parallel.pipeline.simulator import simulate
from parallel.pipeline.timeline import (
    BACKWARD_COLORS,
    FORWARD_COLORS,
    bars,
    bubble_fraction,
    draw_timeline,
)


def test_bars_follow_the_timeline_and_bubble_matches_the_simulator():
    r = simulate(interleaved_1f1b(2, 4, 2))
    bs = bars(r.timeline)
    computes = [b for b in bs if b.compute]
    assert len(computes) == 2 * 2 * 4 * 2  # stages × (F + B) × m × vpp
    assert {b.color for b in computes} == {FORWARD_COLORS[0], FORWARD_COLORS[1], BACKWARD_COLORS[0], BACKWARD_COLORS[1]}
    assert bubble_fraction(r.timeline) == pytest.approx(r.bubble_fraction)
    first = r.timeline[0][0]
    assert first.action == Forward(0, 0) and computes[0].start == first.start and computes[0].label == "0"


def test_png_has_one_row_per_stage_in_the_schedule_colours(tmp_path):
    r = simulate(one_f_one_b(4, 8))
    path = draw_timeline(r.timeline, tmp_path / "t.png", title="1F1B", width_in=8, dpi=50)
    img = mpimg.imread(path)[..., :3]
    assert img.shape[1] == 400  # 8 in × 50 dpi
    for colour in (FORWARD_COLORS[0], BACKWARD_COLORS[0]):
        mask = np.all(np.abs(img - np.array(to_rgb(colour))) < 0.02, axis=-1)
        rows = np.flatnonzero(mask.any(axis=1))
        # four separate horizontal bands of boxes: one per stage (plus the legend swatch)
        bands = 1 + np.count_nonzero(np.diff(rows) > 1)
        assert bands >= 4, (colour, bands)
