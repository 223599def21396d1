"""A CFG run builds its LLM text encoder once for the prompt and the negative prompt together (Z-Image, Qwen-Image):
the encoder is a 4 B / 7 B model, and under keep="none" or a memory limit a second build would read its weights
(or the resident part of a streamed one) from the file again."""

import mlxdiff
from qwenimage_helpers import qwen_tiny  # noqa: F401  (the fixture)
from zimage_helpers import zimage_tiny  # noqa: F401  (the fixture)


def encoder_builds(folder, **kw):
    pipe = mlxdiff.load(str(folder), dtype="float32", keep="none")
    used = []
    use = pipe.use

    def counted(spec, result=None):
        used.append(spec.name)
        return use(spec, result)
    pipe.use = counted
    pipe.generate("a fox", width=48, height=32, steps=2, progress_bar=False, **kw)
    return used.count("text_encoder")


def test_zimage_cfg_builds_its_encoder_once(zimage_tiny):  # noqa: F811
    builds = encoder_builds(zimage_tiny[0], guidance=3.5, negative_prompt="blurry")
    assert builds == 1, builds


def test_qwenimage_true_cfg_builds_its_encoder_once(qwen_tiny):  # noqa: F811
    builds = encoder_builds(qwen_tiny[0], true_cfg_scale=2.5, negative_prompt="blurry")
    assert builds == 1, builds
