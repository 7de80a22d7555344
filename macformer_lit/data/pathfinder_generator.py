"""Pathfinder image generator (Linsley et al., NeurIPS 2018), with the LRA 32×32 settings.

A numpy/Pillow port of ``snakes.py`` and ``snakes2.py`` in
https://github.com/drewlinsley/pathfinder (the generator of the Long Range Arena
``pathfinder32`` release). The drawing follows that code step by step: paddles drawn at
``antialias_scale`` times the resolution and shrunk with Lanczos resampling (as
``scipy.misc.imresize`` did, through Pillow), an occupancy mask dilated with OpenCV's
semantics, continuity-weighted sampling of each next paddle, two target contours seeded
``seed_distance`` apart, short distractor contours, two circular markers, and the final
``scipy.misc.imsave`` byte scaling (the brightest pixel becomes 255). Checked: for 100
seeds the images are byte-identical to a line-by-line transliteration of ``snakes2.py``
run with OpenCV 5.0 and the same random draws.

Where the original draws from numpy's global random state, each image here draws from its
own generator seeded by ``(seed, image index)``: the same seed gives the same images
whatever the number of processes.

One behaviour of the original is kept on purpose (``opencv_border=True``): before seeding
a contour, ``cv2.dilate`` runs on a float mask with OpenCV's default border, which reads
-DBL_MAX off the image; with the head-centred seed kernel some border pixels then get
-DBL_MAX, ``find_available_coordinates`` sees a negative value and reports *no* free pixel,
and the seed fails. At 32×32 this lets only seed orientations of about −150°…−121° succeed
(the first target contour always starts heading up-left; distractors often fail to seed:
about 1.0 distractor contour per image instead of 5), and costs many retries.
``opencv_border=False`` reads off-image pixels as occupied instead: seeds of any
orientation, about 4.7 distractor contours per image, a different (not LRA's) image
distribution.

Parameters (:class:`PathfinderParams`; defaults = the LRA ``Pathfinder32`` TFDS builder
docstring, other values = the defaults of ``snakes2_wrapper.py``):

==============================  =========  ==================================================
name                            default    meaning
==============================  =========  ==================================================
window_size                     32         image height = width (pixels)
padding                         1          border (pixels) that nothing may be seeded in
antialias_scale                 2          supersampling factor for paddles and markers
paddle_margin_list              (1,)       free space around each paddle (one drawn per image)
seed_distance                   7          distance between the two target contours' seeds;
                                           the first seed lies ≥ 2·7 px from the border
marker_radius                   1.5        radius of the two circular markers
contour_length                  14         paddles per target contour (9 and 6: easier sets)
paddle_length                   2          paddle length (pixels)
paddle_thickness                0.5        paddle thickness (pixels, before antialiasing)
continuity                      1.0        turning penalty: weight cos²(min(Δθ·c, π/2))
distractor_length               14 // 3    paddles per distractor contour
num_distractor_snakes           20 // 4    distractor contours (fewer if no room)
snake_contrast_list             (2.0,)     contour contrast (distractors use it as is)
paddle_contrast_list            (0.75,)    per-paddle contrast factor of the target contours
use_single_paddles              False      isolated paddles as extra clutter (off in LRA)
max_target_contour_retrial      4          kept for fidelity (unused by snakes2, as there)
max_distractor_contour_retrial  4          retries per distractor contour
max_paddle_retrial              2          retries per paddle
opencv_border                   True       keep OpenCV's border quirk when seeding (above)
==============================  =========  ==================================================

Labels: 1 when both markers sit on the two ends of the same target contour, 0 when they
sit on the start of one target contour and the far end of the other (drawn with
probability ½ each). Output layout (as the release): ``OUT/imgs/<batch>/sample_<j>.png``
(8-bit grayscale PNG) and ``OUT/metadata/<batch>.npy``, a *text* file with one line per
image: ``imgs/<batch> sample_<j>.png <j> <label> <continuity> <contour_length>
<distractor_length> <paddle_length> <paddle_thickness> <margin> <n_paddle_contrasts>``.

Command line::

    python -m macformer_lit.data.pathfinder_generator --out data/lra/pathfinder32/\\
curv_contour_length_14 --num 200000 --seed 0 [--workers 2] [--grid samples.png]
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from macformer_lit.data.staging import remove_stale_temporaries, staging_path
from macformer_lit.interrupts import ignore_in_worker

__all__ = [
    "PathfinderParams",
    "PathfinderSample",
    "render_sample",
    "generate_pathfinder",
    "save_sample_grid",
]


@dataclass(frozen=True)
class PathfinderParams:
    window_size: int = 32
    padding: int = 1
    antialias_scale: int = 2
    paddle_margin_list: tuple[int, ...] = (1,)
    seed_distance: int = 7
    marker_radius: float = 1.5
    contour_length: int = 14
    paddle_length: int = 2
    paddle_thickness: float = 0.5
    continuity: float = 1.0
    distractor_length: int | None = None
    num_distractor_snakes: int | None = None
    snake_contrast_list: tuple[float, ...] = (2.0,)
    paddle_contrast_list: tuple[float, ...] = (0.75,)
    use_single_paddles: bool = False
    max_target_contour_retrial: int = 4
    max_distractor_contour_retrial: int = 4
    max_paddle_retrial: int = 2
    opencv_border: bool = True

    def __post_init__(self) -> None:
        # LRA: distractor_length = contour_length // 3, num_distractor_snakes = 20 // that.
        if self.distractor_length is None:
            object.__setattr__(self, "distractor_length", max(1, self.contour_length // 3))
        if self.num_distractor_snakes is None:
            object.__setattr__(self, "num_distractor_snakes", 20 // self.distractor_length)
        scaled = self.paddle_thickness * self.antialias_scale
        if round(scaled) != scaled:
            raise ValueError("paddle_thickness * antialias_scale must be an integer")
        if self.padding < 1:
            raise ValueError("padding must be at least 1 (snakes2 marks mask[-padding:])")
        if self.window_size <= 4 * self.seed_distance:
            raise ValueError("window_size must exceed 4 * seed_distance (seed placement)")


@dataclass
class PathfinderSample:
    image: np.ndarray  # (H, W) uint8, what is saved as PNG
    label: int
    # Float layers of the two target contours (no markers, no distractors): for tests.
    snakes: tuple[np.ndarray, np.ndarray]
    marker_coords: tuple[tuple[int, int], tuple[int, int]]
    marker_snakes: tuple[int, int]  # which target contour each marker sits on
    margin: int = 1


class _Failure(Exception):
    """A drawing step found no room; the caller retries as the original code does."""


def _translate(coord, orientation: float, dist: float) -> list[int]:
    # snakes.translate_coord rounds up (ceil), not to nearest.
    return [
        int(math.ceil(coord[0] + dist * math.sin(orientation))),
        int(math.ceil(coord[1] + dist * math.cos(orientation))),
    ]


def _flip(orientation: float) -> float:
    return orientation + math.pi if orientation < 0 else orientation - math.pi


@lru_cache(maxsize=16)
def _disk(radius: int) -> np.ndarray:
    y, x = np.ogrid[-radius : radius + 1, -radius : radius + 1]
    return x**2 + y**2 <= radius**2


@lru_cache(maxsize=8192)
def _taps(shape: tuple[int, int], kernel_bytes: bytes) -> tuple[tuple[int, int], ...]:
    taps = np.argwhere(np.frombuffer(kernel_bytes, dtype=bool).reshape(shape))
    if len(taps) == 0:
        # OpenCV falls back to the single tap at the kernel's corner (checked on cv2 5.0).
        return ((0, 0),)
    return tuple((int(i), int(j)) for i, j in taps)


def _dilate(image: np.ndarray, kernel: np.ndarray, border: float = -np.inf) -> np.ndarray:
    """``cv2.dilate(image, kernel.astype(uint8))`` for float images: out[y, x] is the max of
    image[y + i - ci, x + j - cj] over non-zero taps (i, j); taps off the image read
    ``border``, by default -inf (OpenCV's default border for dilation is the lowest value
    of the type)."""
    kh, kw = kernel.shape
    ci, cj = kh // 2, kw // 2
    h, w = image.shape
    padded = np.full((h + kh - 1, w + kw - 1), border)
    padded[ci : ci + h, cj : cj + w] = image
    taps = _taps(kernel.shape, np.ascontiguousarray(kernel, dtype=bool).tobytes())
    i, j = taps[0]
    out = padded[i : i + h, j : j + w].copy()
    for i, j in taps[1:]:
        np.maximum(out, padded[i : i + h, j : j + w], out=out)
    return out


def _bytescale(data: np.ndarray) -> np.ndarray:
    """``scipy.misc.bytescale`` (used by imsave/imresize on float arrays): min..max → 0..255."""
    if data.dtype == np.uint8:
        return data
    cmin, cmax = float(data.min()), float(data.max())
    cscale = (cmax - cmin) or 1.0
    scaled = (data - cmin) * (255.0 / cscale)
    return (scaled.clip(0, 255) + 0.5).astype(np.uint8)


def _imresize_lanczos(data: np.ndarray, size: int) -> np.ndarray:
    """``scipy.misc.imresize(data, (size, size), interp='lanczos')`` → uint8."""
    image = Image.fromarray(_bytescale(data), mode="L")
    return np.asarray(image.resize((size, size), resample=Image.Resampling.LANCZOS))


@lru_cache(maxsize=8192)
def _paddle_patch(
    orientation: float, length: int, thickness: float, margin: int, aa_scale: int
) -> tuple[np.ndarray, np.ndarray]:
    """One paddle and its occupancy mask on a small (2h+1)² patch centred on its start
    (``snakes.draw_line_n_mask`` before placement). Cached: orientations repeat a lot."""
    half = length + int(math.ceil(thickness)) + margin
    blown_shape = half * 2 * aa_scale + 1
    blown_centre = half * aa_scale
    head = _translate([blown_centre, blown_centre], orientation, length * aa_scale)
    blown = Image.new("F", (blown_shape, blown_shape), 0.0)
    ImageDraw.Draw(blown).line(
        [(blown_centre, blown_centre), (head[1], head[0])],
        fill=255.0,
        width=int(round(thickness * aa_scale)),
    )
    blown_arr = np.array(blown)
    size = half * 2 + 1
    line = _imresize_lanczos(blown_arr, size).astype(np.float64) / 255
    blown_mask = _dilate(blown_arr, _disk(margin * aa_scale)).astype(np.uint8)
    mask = _imresize_lanczos(blown_mask, size).astype(np.float64) / 255
    line.flags.writeable = False
    mask.flags.writeable = False
    return line, mask


def _draw_paddle(
    im_size: tuple[int, int],
    start,
    orientation: float,
    length: int,
    thickness: float,
    margin: int,
    aa_scale: int,
    contrast: float = 1.0,
) -> tuple[np.ndarray, np.ndarray]:
    """``snakes.draw_line_n_mask``: the paddle image (× contrast) and its mask, full size."""
    line, mask = _paddle_patch(float(orientation), length, thickness, margin, aa_scale)
    half = length + int(math.ceil(thickness)) + margin
    h, w = im_size
    r0, c0 = int(start[0]) - half, int(start[1]) - half
    rr = slice(max(r0, 0), min(r0 + 2 * half, h - 1) + 1)
    cc = slice(max(c0, 0), min(c0 + 2 * half, w - 1) + 1)
    pr = slice(rr.start - r0, rr.stop - r0)
    pc = slice(cc.start - c0, cc.stop - c0)
    # float32, as the original's PIL 'F' canvases: the rounding shows in the final bytes.
    l_im = np.zeros(im_size, dtype=np.float32)
    m_im = np.zeros(im_size, dtype=np.float32)
    if rr.stop > rr.start and cc.stop > cc.start:
        l_im[rr, cc] = line[pr, pc] * contrast if contrast != 1.0 else line[pr, pc]
        m_im[rr, cc] = mask[pr, pc]
    return l_im, m_im


@lru_cache(maxsize=4096)
def _circle(window: int, row: int, col: int, radius: float, aa_scale: int) -> np.ndarray:
    """``snakes2.draw_circle``: an antialiased disk, uint8 (H, W)."""
    y, x = np.ogrid[
        -row * aa_scale : (window - row) * aa_scale, -col * aa_scale : (window - col) * aa_scale
    ]
    big = np.zeros((window * aa_scale, window * aa_scale))
    big[x**2 + y**2 <= (radius * aa_scale) ** 2] = 1
    return _imresize_lanczos(big, window)


def _available(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``find_available_coordinates(np.ceil(mask - 0.3), 0)``: free pixels, none at all if
    the mask has a negative value (an off-image dilation result)."""
    occupied = np.ceil(mask - 0.3)
    if occupied.min() < 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty
    return np.nonzero(occupied == 0)


def _in_bounds(coord, shape) -> bool:
    return 0 <= coord[0] < shape[0] and 0 <= coord[1] < shape[1]


@lru_cache(maxsize=8192)
def _seed_struct(
    orientation: float,
    length: int,
    thickness: float,
    margin: int,
    aa_scale: int,
    window: int,
    quirk: bool = True,
) -> tuple[np.ndarray, bool]:
    """The head-centred paddle mask that ``seed_snake`` dilates the occupancy with, as cv2
    taps (``struct.astype(uint8)``: only fully covered pixels), and whether every pixel of a
    window-sized image has an in-image tap. When one has none, cv2 writes -DBL_MAX there
    and ``find_available_coordinates`` then reports no free pixel at all, so the seed fails
    at once: the original's behaviour, kept, and the reason most seed orientations fail."""
    side = (length + margin) * 2 + 1
    head = [length + margin + 1] * 2
    _, struct = _draw_paddle((side, side), head, orientation, length, thickness, margin, aa_scale)
    taps = struct >= 1.0
    covers = not quirk or not np.isneginf(_dilate(np.zeros((window, window)), taps)).any()
    taps.flags.writeable = False
    return taps, covers


@lru_cache(maxsize=8192)
def _first_seed_free(
    orientation: float,
    length: int,
    thickness: float,
    margin: int,
    aa_scale: int,
    window: int,
    padding: int,
    seed_distance: int,
    quirk: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Free pixels for the first target seed (``initialize_two_seeds``): the occupancy is
    then only the borders, so the answer depends on the orientation alone (cached)."""
    taps, _ = _seed_struct(orientation, length, thickness, margin, aa_scale, window)
    lined = np.zeros((window, window))
    # Border padding, and 2·seed_distance kept free of the first seed.
    d = max(padding, 2 * seed_distance)
    lined[:d, :] = lined[window - d :, :] = lined[:, :d] = lined[:, window - d :] = 1
    rows, cols = _available(_dilate(lined, taps, -np.inf if quirk else 1.0))
    rows.flags.writeable = False
    cols.flags.writeable = False
    return rows, cols


class _Drawer:
    """Per-image state: the random generator and the parameters."""

    def __init__(self, rng: np.random.Generator, p: PathfinderParams, margin: int) -> None:
        self.rng = rng
        self.p = p
        self.margin = margin
        self.shape = (p.window_size, p.window_size)
        self.small_struct = _disk(margin)

    def paddle(self, start, orientation, contrast=1.0, shape=None):
        p = self.p
        return _draw_paddle(
            shape or self.shape,
            start,
            orientation,
            p.paddle_length,
            p.paddle_thickness,
            self.margin,
            p.antialias_scale,
            contrast,
        )

    def random_orientation(self) -> float:
        return int(self.rng.integers(-180, 180)) * math.pi / 180

    def seed_struct(self, orientation: float) -> tuple[np.ndarray, bool]:
        p = self.p
        return _seed_struct(
            orientation,
            p.paddle_length,
            p.paddle_thickness,
            self.margin,
            p.antialias_scale,
            p.window_size,
            p.opencv_border,
        )

    def seed(self, image, mask, contrast, stop_with_availability):
        """``snakes.seed_snake``: first paddle of a distractor contour."""
        p, length = self.p, self.p.paddle_length
        for _ in range(p.max_paddle_retrial + 1):
            orientation = self.random_orientation()
            reverse = (
                orientation + math.pi if orientation + math.pi < math.pi else orientation - math.pi
            )
            raw = _available(mask)[0].size
            if stop_with_availability is not None and raw / mask.size < stop_with_availability:
                raise _Failure
            struct, covers = self.seed_struct(orientation)
            if not covers:
                # The dilation would hold -inf, so no pixel would count as free.
                raise _Failure
            lined = mask.copy()
            lined[0, :] = lined[-1, :] = lined[:, 0] = lined[:, -1] = 1
            border = -np.inf if self.p.opencv_border else 1.0
            rows, cols = _available(_dilate(lined, struct, border))
            if rows.size == 0:
                raise _Failure
            k = int(self.rng.integers(0, rows.size))
            tail = [int(rows[k]), int(cols[k])]
            head = _translate(tail, orientation, length)
            pivot = _translate(head, reverse, length + self.margin)
            if _in_bounds(head, mask.shape) and _in_bounds(pivot, mask.shape):
                break
        else:
            raise _Failure
        l_im, m_im = self.paddle(tail, orientation, contrast)
        return np.maximum(image, l_im), m_im, pivot, orientation

    def extend(self, pivot, orientation, segment_mask, image, mask, contrast):
        """``snakes.extend_snake``: the next paddle, continuity-weighted, not overlapping."""
        p, length, margin = self.p, self.p.paddle_length, self.margin
        new_pivot = _translate(pivot, orientation, length + 2 * margin)
        dilated = _dilate(mask, self.small_struct)
        coords, orientations, cmf = _candidates(
            new_pivot, orientation, length + margin, dilated, p.continuity
        )
        if cmf is None:
            raise _Failure
        for _ in range(p.max_paddle_retrial + 1):
            k = int(np.argmax(cmf - self.rng.random() > 0))
            new_orientation = float(orientations[k])
            new_head = coords[k]
            l_im, m_im = self.paddle(new_head, _flip(new_orientation), contrast)
            if np.max(mask + m_im) < 1.8:
                break
        else:
            raise _Failure
        image = np.maximum(image, l_im)
        mask = np.maximum(mask, segment_mask)
        return image, mask, m_im, new_pivot, new_orientation, [int(v) for v in new_head]

    def snake(self, image, mask, num_segments, contrast_list, stop_with_availability):
        """``snakes.make_snake``; raises _Failure (the caller keeps its old image/mask)."""
        contrast = contrast_list[int(self.rng.integers(0, len(contrast_list)))]
        image, segment_mask, pivot, orientation = self.seed(
            image, mask, contrast, stop_with_availability
        )
        for _ in range(num_segments - 1):
            contrast = contrast_list[int(self.rng.integers(0, len(contrast_list)))]
            image, mask, segment_mask, pivot, orientation, _ = self.extend(
                pivot, orientation, segment_mask, image, mask, contrast
            )
        return image, np.maximum(mask, segment_mask)

    def many_snakes(self, image, mask, num_snakes, max_snake_trial, num_segments, contrasts):
        """``snakes.make_many_snakes`` with allow_incomplete=True, stop_with_availability=1 %."""
        for _ in range(num_snakes):
            for _ in range(max_snake_trial + 1):
                try:
                    image, mask = self.snake(image, mask, num_segments, contrasts, 0.01)
                    break
                except _Failure:
                    continue
        return image, mask

    def two_seeds(self, mask, contrasts):
        """``snakes2.initialize_two_seeds``: the target contours' first paddles."""
        p, length, margin = self.p, self.p.paddle_length, self.margin
        n = p.window_size
        images, segment_masks, pivots, orientations, tips = [], [], [], [], []
        for which in range(2):
            if len(p.paddle_contrast_list) > 1:
                idx = int(self.rng.integers(0, len(p.paddle_contrast_list)))
            else:
                idx = 0
            contrast = p.paddle_contrast_list[idx] * contrasts[which]
            for _ in range(p.max_paddle_retrial + 1):
                orientation = self.random_orientation()
                reverse = (
                    orientation + math.pi
                    if orientation + math.pi < math.pi
                    else orientation - math.pi
                )
                if which == 0:
                    rows, cols = _first_seed_free(
                        orientation,
                        p.paddle_length,
                        p.paddle_thickness,
                        margin,
                        p.antialias_scale,
                        n,
                        p.padding,
                        p.seed_distance,
                        p.opencv_border,
                    )
                    if rows.size == 0:
                        raise _Failure
                    k = int(self.rng.integers(0, rows.size))
                    tail = [int(rows[k]), int(cols[k])]
                else:
                    angle = int(self.rng.integers(0, 360)) * math.pi / 180
                    tail = [
                        int(np.round(tips[0][0] + p.seed_distance * math.sin(angle))),
                        int(np.round(tips[0][1] + p.seed_distance * math.cos(angle))),
                    ]
                head = _translate(tail, orientation, length)
                pivot = _translate(head, reverse, length + margin)
                if _in_bounds(head, mask.shape) and _in_bounds(pivot, mask.shape):
                    break
            else:
                raise _Failure
            l_im, m_im = self.paddle(tail, orientation, contrast)
            images.append(l_im)
            segment_masks.append(m_im)
            pivots.append(pivot)
            orientations.append(orientation)
            tips.append(tail)
        return images, segment_masks, pivots, orientations, tips

    def two_snakes(self):
        """``snakes2.two_snakes``: the two target contours, grown paddle by paddle in turn."""
        p = self.p
        mask = np.zeros(self.shape)
        pad = p.padding
        mask[:pad, :] = mask[-pad:, :] = mask[:, :pad] = mask[:, -pad:] = 1
        contrasts = list(self.rng.permutation(list(p.snake_contrast_list) * 2)[:2])
        images, segment_masks, pivots, orientations, origin_tips = self.two_seeds(mask, contrasts)
        terminal_tips = [[0, 0], [0, 0]]
        for _ in range(p.contour_length - 1):
            idx = int(self.rng.integers(0, len(p.paddle_contrast_list)))
            contrast = p.paddle_contrast_list[idx]
            for s in range(2):
                images[s], mask, segment_masks[s], pivots[s], orientations[s], terminal_tips[s] = (
                    self.extend(
                        pivots[s],
                        orientations[s],
                        segment_masks[s],
                        images[s],
                        mask,
                        contrast * contrasts[s],
                    )
                )
        # As in the original, only the second contour's last paddle joins the mask.
        mask = np.maximum(mask, segment_masks[-1])
        return images, mask, origin_tips, terminal_tips


@lru_cache(maxsize=16384)
def _circle_points(row: int, col: int, step: int, h: int, w: int):
    """In-image pixels on a circle of radius ``step`` around (row, col), as
    ``get_coords_cmf`` finds them, with their orientations (cached: pivots repeat)."""
    deg_per_pixel = 360.0 / (2 * step * np.pi)
    angles = np.arange(0, 360, deg_per_pixel) * np.pi / 180
    ys = row + step * np.sin(angles)
    xs = col + step * np.cos(angles)
    inside = (ys < h) & (ys >= 0) & (xs < w) & (xs >= 0)
    coords = np.stack([ys, xs], axis=1).astype(int)[inside]
    if coords.shape[0] == 0:
        return None, None
    coords = np.unique(coords, axis=0)
    disp = coords - np.array([row, col])
    orientations = np.arctan2(disp[:, 0], disp[:, 1])
    coords.flags.writeable = False
    orientations.flags.writeable = False
    return coords, orientations


def _candidates(last_endpoint, last_orientation, step, mask, continuity):
    """``snakes.get_coords_cmf``: pixels on a circle of radius ``step`` around the pivot,
    weighted by free space and by cos² of the (scaled) turning angle."""
    coords, orientations = _circle_points(
        int(last_endpoint[0]), int(last_endpoint[1]), int(step), *mask.shape
    )
    if coords is None:
        return None, None, None
    delta = np.abs(orientations - last_orientation)
    delta = np.minimum(np.minimum(delta, 2 * np.pi - delta) * continuity, 0.5 * np.pi)
    pmf = (1 - mask[coords[:, 0], coords[:, 1]]) * np.maximum(np.cos(delta), 0) ** 2
    total = pmf.sum()
    if total < 1e-4:
        return None, None, None
    return coords, orientations, np.cumsum(pmf / total)


# Guard against parameters under which the target contours never fit.
_MAX_TARGET_ATTEMPTS = 10_000


def render_sample(
    rng: np.random.Generator, params: PathfinderParams | None = None
) -> PathfinderSample:
    """Draw one image (``snakes2.from_wrapper``'s loop body) from ``rng``."""
    p = params or PathfinderParams()
    label = int(rng.integers(0, 2))
    margin = p.paddle_margin_list[int(rng.integers(0, len(p.paddle_margin_list)))]
    drawer = _Drawer(rng, p, margin)
    for _ in range(_MAX_TARGET_ATTEMPTS):
        try:
            snakes, mask, origin_tips, terminal_tips = drawer.two_snakes()
            break
        except _Failure:
            continue
    else:
        raise RuntimeError(f"target contours did not fit in {_MAX_TARGET_ATTEMPTS} attempts: {p}")
    image = np.maximum(snakes[0], snakes[1])
    if p.num_distractor_snakes > 0:
        image, mask = drawer.many_snakes(
            image,
            mask,
            p.num_distractor_snakes,
            p.max_distractor_contour_retrial,
            p.distractor_length,
            p.snake_contrast_list,
        )
    if p.use_single_paddles:
        num_paddles = int(150 / ((7.5 + 13 * margin + 4 * margin * margin) / 123.5))
        singles = num_paddles - 2 * p.contour_length - p.num_distractor_snakes * p.distractor_length
        image, _ = drawer.many_snakes(
            image, mask, singles, p.max_paddle_retrial, 1, p.snake_contrast_list
        )
    origin = int(rng.integers(0, 2))
    terminal = origin if label == 1 else 1 - origin
    a, b = origin_tips[origin], terminal_tips[terminal]
    circles = np.maximum(
        _circle(p.window_size, a[0], a[1], p.marker_radius, p.antialias_scale),
        _circle(p.window_size, b[0], b[1], p.marker_radius, p.antialias_scale),
    )
    marked = np.maximum(image, circles.astype(np.float64) / 255)
    return PathfinderSample(
        image=_bytescale(marked),
        label=label,
        snakes=(snakes[0], snakes[1]),
        marker_coords=((a[0], a[1]), (b[0], b[1])),
        marker_snakes=(origin, terminal),
        margin=margin,
    )


def _rng(seed: int, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, index])


def _metadata_line(batch: int, j: int, label: int, margin: int, p: PathfinderParams) -> str:
    fields = [
        f"imgs/{batch}",
        f"sample_{j}.png",
        j,
        label,
        p.continuity,
        p.contour_length,
        p.distractor_length,
        p.paddle_length,
        p.paddle_thickness,
        margin,
        len(p.paddle_contrast_list),
    ]
    return " ".join(str(f) for f in fields)


def _render_chunk(task) -> list[tuple[int, int, str]]:
    """Worker: render images [start, stop) of one batch folder, write PNGs, return metadata."""
    out, seed, params_dict, batch, start, stop, per_batch = task
    params = PathfinderParams(**params_dict)
    folder = Path(out) / "imgs" / str(batch)
    rows = []
    for j in range(start, stop):
        sample = render_sample(_rng(seed, batch * per_batch + j), params)
        # Written whole or not at all (a kill mid-write leaves a temporary, removed later).
        path = folder / f"sample_{j}.png"
        tmp = staging_path(path)
        Image.fromarray(sample.image, mode="L").save(tmp, format="PNG")
        os.replace(tmp, path)
        rows.append((batch, j, _metadata_line(batch, j, sample.label, sample.margin, params)))
    return rows


def generate_pathfinder(
    out_dir: str | os.PathLike,
    num: int,
    *,
    seed: int = 0,
    params: PathfinderParams | None = None,
    images_per_batch: int = 1000,
    workers: int | None = None,
    chunk_size: int = 50,
    progress: bool = True,
) -> dict:
    """Write ``num`` images in the release layout under ``out_dir``; returns statistics
    (count, seconds, images/s, positive fraction). Image ``k`` is drawn from the generator
    seeded by ``(seed, k)``, so results do not depend on ``workers`` or ``chunk_size``."""
    if num <= 0 or images_per_batch <= 0 or chunk_size <= 0:
        raise ValueError("num, images_per_batch and chunk_size must be positive")
    params = params or PathfinderParams()
    out = Path(out_dir)
    workers = workers or os.cpu_count() or 1
    tasks = []
    # Leftovers of a generation killed outright (SIGKILL): its temporaries go now.
    remove_stale_temporaries(out / "metadata")
    for batch in range(math.ceil(num / images_per_batch)):
        (out / "imgs" / str(batch)).mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(out / "imgs" / str(batch))
        count = min(images_per_batch, num - batch * images_per_batch)
        for start in range(0, count, chunk_size):
            stop = min(start + chunk_size, count)
            tasks.append((str(out), seed, asdict(params), batch, start, stop, images_per_batch))
    (out / "metadata").mkdir(parents=True, exist_ok=True)

    from tqdm.auto import tqdm

    rows: list[tuple[int, int, str]] = []
    started = time.perf_counter()
    with tqdm(total=num, desc="pathfinder", unit="img", disable=not progress) as bar:
        if workers == 1:
            for task in tasks:
                rows += _render_chunk(task)
                bar.update(task[5] - task[4])
        else:
            # spawn, not fork: the caller may already run torch threads. Workers that die
            # raise BrokenProcessPool here instead of hanging as a multiprocessing.Pool would.
            context = mp.get_context("spawn")
            pool = ProcessPoolExecutor(workers, mp_context=context, initializer=ignore_in_worker)
            with pool:
                for future in as_completed([pool.submit(_render_chunk, t) for t in tasks]):
                    chunk = future.result()
                    rows += chunk
                    bar.update(len(chunk))
    seconds = time.perf_counter() - started

    rows.sort()
    by_batch: dict[int, list[str]] = {}
    for batch, _, line in rows:
        by_batch.setdefault(batch, []).append(line)
    # Text lines, newline-terminated, as the released files (despite the .npy name). The
    # metadata marks a folder as generated: all of it is staged first, then renamed.
    staged = []
    try:
        for batch, lines in by_batch.items():
            path = out / "metadata" / f"{batch}.npy"
            staged.append((staging_path(path), path))
            staged[-1][0].write_text("\n".join(lines) + "\n")
        for tmp, path in staged:
            os.replace(tmp, path)
    finally:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
    positives = sum(int(line.split()[3]) for _, _, line in rows)
    return {
        "num": num,
        "seconds": seconds,
        "images_per_second": num / seconds if seconds > 0 else float("inf"),
        "positive_fraction": positives / num,
        "workers": workers,
    }


def save_sample_grid(
    path: str | os.PathLike,
    *,
    per_class: int = 4,
    seed: int = 0,
    params: PathfinderParams | None = None,
) -> None:
    """A PNG with ``per_class`` positive (top row) and negative (bottom row) examples."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    found: dict[int, list[np.ndarray]] = {0: [], 1: []}
    k = 0
    while min(len(v) for v in found.values()) < per_class:
        sample = render_sample(_rng(seed, k), params)
        if len(found[sample.label]) < per_class:
            found[sample.label].append(sample.image)
        k += 1
    fig, axes = plt.subplots(2, per_class, figsize=(2 * per_class, 4.4))
    for row, label in enumerate((1, 0)):
        for col, image in enumerate(found[label]):
            ax = axes[row, col]
            ax.imshow(image, cmap="gray", vmin=0, vmax=255, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if col == 0:
                ax.set_ylabel("connected (1)" if label else "not connected (0)")
    fig.suptitle("Pathfinder-32, contour length 14 (macformer_lit generator)")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m macformer_lit.data.pathfinder_generator",
        description="Generate Pathfinder images in the LRA release layout (imgs/, metadata/).",
    )
    parser.add_argument(
        "--out", required=True, help="e.g. data/lra/pathfinder32/curv_contour_length_14"
    )
    parser.add_argument("--num", type=int, required=True, help="number of images")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=None, help="processes (default: all cores)")
    parser.add_argument("--images-per-batch", type=int, default=1000, help="images per imgs/<b>/")
    parser.add_argument("--contour-length", type=int, default=14, help="14 (hard), 9, 6 (easy)")
    parser.add_argument("--grid", default=None, help="also save a PNG of examples to this path")
    args = parser.parse_args(argv)
    params = PathfinderParams(contour_length=args.contour_length)
    stats = generate_pathfinder(
        args.out,
        args.num,
        seed=args.seed,
        params=params,
        images_per_batch=args.images_per_batch,
        workers=args.workers,
    )
    print(
        f"wrote {stats['num']} images to {args.out} in {stats['seconds']:.1f} s "
        f"({stats['images_per_second']:.1f} images/s, {stats['workers']} workers, "
        f"{100 * stats['positive_fraction']:.1f} % positive)"
    )
    if args.grid:
        save_sample_grid(args.grid, seed=args.seed, params=params)
        print(f"saved examples to {args.grid}")


if __name__ == "__main__":
    main()
