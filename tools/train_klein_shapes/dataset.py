"""Procedural shapes at 64x64 with captions, for training the embedded default model (klein-shapes).

One or two flat shapes (circle, square, triangle, diamond) in six hues 60 degrees apart, at a named position (left,
right, top, bottom, centre), small or large, on an achromatic background (white, black, gray), so that a simple hue
mask finds the shapes. Captions are built from the same description with varied wording. Everything is
deterministic from a seed (numpy Generator).

A set of (colour, shape, position) combinations, HELD_OUT, never appears in any training image (neither as the only
shape nor as one of two); tests/test_default_model.py prompts exactly those.
"""

import colorsys
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

SIZE = 64
SUPERSAMPLE = 4          # drawn at 256x256 and box-filtered down: smooth edges

COLOURS = {              # hues 0, 60, 120, 180, 240, 300 degrees
    "red": (220, 30, 30), "yellow": (230, 220, 30), "green": (30, 180, 40),
    "cyan": (30, 200, 220), "blue": (40, 50, 225), "magenta": (215, 40, 215),
}
BACKGROUNDS = {"white": (245, 245, 245), "black": (12, 12, 12), "gray": (128, 128, 128)}
SHAPES = ("circle", "square", "triangle", "diamond")
POSITIONS = ("left", "right", "top", "bottom", "centre")
CENTRES = {"left": (16, 32), "right": (48, 32), "top": (32, 16), "bottom": (32, 48), "centre": (32, 32)}
HALF_EXTENT = {"small": 7.0, "large": 12.5}   # a large shape on the left still lies within the left half
PAIRS = (("left", "right"), ("top", "bottom"))

# (colour, shape, position) never drawn in training: for each (colour, shape) exactly one position
HELD_OUT = frozenset((c, s, p) for ci, c in enumerate(COLOURS) for si, s in enumerate(SHAPES)
                     for pi, p in enumerate(POSITIONS) if (ci + 2 * si + 3 * pi) % 5 == 0)

PLACE = {"left": ["on the left", "at the left", "on the left side"],
         "right": ["on the right", "at the right", "on the right side"],
         "top": ["at the top", "on top", "at the top of the image"],
         "bottom": ["at the bottom", "at the bottom of the image", "on the bottom"],
         "centre": ["in the centre", "in the center", "in the middle"]}
BACKGROUND_WORDING = ["on a {bg} background", "with a {bg} background", ", {bg} background", "over {bg}"]


@dataclass(frozen=True)
class Item:
    colour: str
    shape: str
    position: str
    size: str


@dataclass(frozen=True)
class Scene:
    items: tuple
    background: str


def place_phrase(position, rng=None):
    return PLACE[position][0] if rng is None else PLACE[position][rng.integers(len(PLACE[position]))]


def describe_item(item: Item, rng=None, with_size=True) -> str:
    words = ["a"] + ([item.size] if with_size else []) + [item.colour, item.shape, place_phrase(item.position, rng)]
    return " ".join(words)


def caption(scene: Scene, rng=None) -> str:
    """A caption of the scene; rng varies the wording (size and background sometimes left out, phrase order),
    rng=None gives the canonical wording."""
    if rng is None:
        parts = [describe_item(item) for item in scene.items]
        return " and ".join(parts) + f" on a {scene.background} background"
    with_size = rng.random() < 0.8
    parts = [describe_item(item, rng, with_size) for item in scene.items]
    if len(parts) == 2 and rng.random() < 0.5:
        parts = parts[::-1]
    text = " and ".join(parts)
    if rng.random() < 0.85:
        wording = BACKGROUND_WORDING[rng.integers(len(BACKGROUND_WORDING))].format(bg=scene.background)
        text = text + ("" if wording.startswith(",") else " ") + wording
    return text


def random_scene(rng, held_out=HELD_OUT) -> Scene:
    """A training scene: one shape (60%) or two in a left/right or top/bottom pair, none of them held out."""
    colours, shapes = list(COLOURS), list(SHAPES)
    background = list(BACKGROUNDS)[rng.integers(len(BACKGROUNDS))]
    positions = ([POSITIONS[rng.integers(len(POSITIONS))]] if rng.random() < 0.6
                 else list(PAIRS[rng.integers(len(PAIRS))]))
    while True:
        picked = rng.choice(len(colours), size=len(positions), replace=False)
        items = tuple(Item(colours[c], shapes[rng.integers(len(shapes))], p,
                           "small" if rng.random() < 0.5 else "large") for c, p in zip(picked, positions))
        if not any((i.colour, i.shape, i.position) in held_out for i in items):
            return Scene(items, background)


def _polygon(shape, cx, cy, r):
    if shape == "square":
        r *= 0.88   # same visual weight as the circle
        return [(cx - r, cy - r), (cx + r, cy - r), (cx + r, cy + r), (cx - r, cy + r)]
    if shape == "diamond":
        return [(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)]
    if shape == "triangle":
        return [(cx, cy - r), (cx + r, cy + r * 0.8), (cx - r, cy + r * 0.8)]
    raise ValueError(shape)


def render(scene: Scene, rng=None) -> Image.Image:
    """The scene as a 64x64 RGB image; rng jitters positions (+-3 px), sizes (+-10%) and colours (+-12 per
    channel) so the model sees a distribution, not 300 fixed pictures."""
    k = SUPERSAMPLE
    image = Image.new("RGB", (SIZE * k, SIZE * k), BACKGROUNDS[scene.background])
    draw = ImageDraw.Draw(image)
    for item in scene.items:
        cx, cy = CENTRES[item.position]
        r = HALF_EXTENT[item.size]
        colour = np.array(COLOURS[item.colour])
        if rng is not None:
            cx, cy = cx + rng.uniform(-3, 3), cy + rng.uniform(-3, 3)
            r *= rng.uniform(0.9, 1.1)
            colour = np.clip(colour + rng.integers(-12, 13, size=3), 0, 255)
        fill = tuple(int(v) for v in colour)
        cx, cy, r = cx * k, cy * k, r * k
        if item.shape == "circle":
            draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
        else:
            draw.polygon(_polygon(item.shape, cx, cy, r), fill=fill)
    return image.resize((SIZE, SIZE), Image.BOX)


def sample(rng):
    """(image, caption, scene) for one training example."""
    scene = random_scene(rng)
    return render(scene, rng), caption(scene, rng), scene


def batch(rng, n):
    """n training examples: uint8 images (n, 64, 64, 3), captions, scenes."""
    images, captions, scenes = [], [], []
    for _ in range(n):
        image, text, scene = sample(rng)
        images.append(np.asarray(image))
        captions.append(text)
        scenes.append(scene)
    return np.stack(images), captions, scenes


def held_out_prompts(n=None, size="large"):
    """Canonical single-shape prompts for the held-out (colour, shape, position) combinations, with the background
    cycling through white, black, gray: [(prompt, Item, background)]."""
    out = []
    for i, (c, s, p) in enumerate(sorted(HELD_OUT, key=lambda t: (list(COLOURS).index(t[0]), SHAPES.index(t[1])))):
        bg = list(BACKGROUNDS)[i % len(BACKGROUNDS)]
        scene = Scene((Item(c, s, p, size),), bg)
        out.append((caption(scene), scene.items[0], bg))
    return out[:n]


def vocabulary() -> list:
    """Every word a caption can contain, plus the words of the chat template (user, assistant)."""
    words = set(COLOURS) | set(BACKGROUNDS) | set(SHAPES) | set(HALF_EXTENT) | {"a", "and", "user", "assistant"}
    for phrases in list(PLACE.values()) + [BACKGROUND_WORDING]:
        for phrase in phrases:
            words |= set(phrase.replace("{bg}", "").replace(",", " , ").split())
    return sorted(words)


# ---- pixel statistics for the semantic test -------------------------------------------------------------------

HUES = {name: colorsys.rgb_to_hsv(*(v / 255 for v in rgb))[0] * 360 for name, rgb in COLOURS.items()}


def hue_masks(image) -> dict:
    """{colour: bool mask (64, 64)} of saturated, bright pixels whose hue is within 30 degrees of the colour's."""
    hsv = np.asarray(image.convert("RGB").convert("HSV")).astype(np.float32) / 255
    hue, sat, val = hsv[..., 0] * 360, hsv[..., 1], hsv[..., 2]
    chromatic = (sat > 0.45) & (val > 0.35)
    masks = {}
    for name, h in HUES.items():
        d = np.abs((hue - h + 180) % 360 - 180)
        masks[name] = chromatic & (d < 30)
    return masks


def region(position, size=SIZE) -> np.ndarray:
    """The region a position names: a half of the image, or the central square for centre."""
    m = np.zeros((size, size), bool)
    h = size // 2
    q = size // 4
    {"left": lambda: m.__setitem__((slice(None), slice(0, h)), True),
     "right": lambda: m.__setitem__((slice(None), slice(h, None)), True),
     "top": lambda: m.__setitem__((slice(0, h), slice(None)), True),
     "bottom": lambda: m.__setitem__((slice(h, None), slice(None)), True),
     "centre": lambda: m.__setitem__((slice(q, size - q), slice(q, size - q)), True)}[position]()
    return m


OPPOSITE = {"left": "right", "right": "left", "top": "bottom", "bottom": "top"}


def pass_rate(images, prompts):
    """(fraction passed, per-prompt bools) of colour_in_region over held_out_prompts()-style [(prompt, Item, bg)]."""
    results = [colour_in_region(image, item.colour, item.position) for image, (_, item, _) in zip(images, prompts)]
    return sum(results) / len(results), results


def colour_counts(image, colour, position, min_fraction=0.04) -> tuple:
    """What colour_in_region compares, in pixels: (the colour's pixels in the region, the coverage it needs there
    (min_fraction of the region), the most frequent other hue's pixels there, the colour's pixels in the opposite
    half (for centre: outside the central square))."""
    masks = hue_masks(image)
    inside = region(position)
    outside = region(OPPOSITE[position]) if position in OPPOSITE else ~inside
    counts = {name: int((m & inside).sum()) for name, m in masks.items()}
    ours = counts.pop(colour)
    return ours, min_fraction * inside.sum(), max(counts.values()), int((masks[colour] & outside).sum())


def colour_in_region(image, colour, position, min_fraction=0.04) -> bool:
    """The prompted colour is drawn in the prompted region: it covers at least min_fraction of the region, it is
    the most frequent hue there, and (for a half) it has more pixels there than in the opposite half (for centre:
    more inside the central square than outside it)."""
    ours, needed, other_hue, opposite = colour_counts(image, colour, position, min_fraction)
    return ours >= needed and ours >= other_hue and ours > opposite
