"""VAE decode at the cost of its activations: the FLUX.2 VAE at its real channel widths (random weights), decoding
a 384x384 image on the CPU as the pipelines do, peak at most the weights plus an allowance derived from the shapes.
Before the staged decode the SD3.5 VAE needed 9.7 GiB above its weights here at 512x512. 384 (not 512) keeps the
suite short; the widest convolutions still run in row bands at it (asserted: a 128-channel 3x3 conv at 384x384
unfolds 0.68 GB, above CPU_CONV_BAND). Not smaller: at 256x256 the SD3.5 VAE's peak (555.6 MB) passed the
allowance (536.9 MB): its band term is fixed while its activation term shrinks with the area.
The SD3.5 VAE's decode is the same code: vae.Model's Decoder at the same widths (128, 256, 512, 512), two layers a
block, mid-block attention, the same banded Conv2d and decode_bytes; FLUX.2's adds only a 1x1 post-quant conv at
the latent resolution (and 32 latent channels into conv_in), so one of the two is decoded here."""

from mlxdiff import backend  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx
from mlx.utils import tree_flatten

from mlxdiff.memory import CPU_CONV_BAND, decide
from mlxdiff.models import vae, vae_flux2
from mlxdiff.pipelines.base import decode_array
from mlxdiff.policy import RunPolicy, installed

from helpers import in_fresh_process, mlx_peak_above_live

SIZE = 384


def _counting_bands():
    """vae.Conv2d with the mx.conv2d calls each of its calls makes counted (a call in bands makes several); returns
    the list of counts. Only in a fresh process: both stay replaced."""
    counts, conv2d, call = [], mx.conv2d, vae.Conv2d.__call__
    inside = [False]

    def counted_conv2d(*args, **kwargs):
        if inside[0]:         # (a plain nn.Conv2d, e.g. FLUX.2's post-quant conv, never bands)
            counts[-1] += 1
        return conv2d(*args, **kwargs)

    def counted_call(self, x):
        counts.append(0)
        inside[0] = True
        try:
            return call(self, x)
        finally:
            inside[0] = False

    mx.conv2d, vae.Conv2d.__call__ = counted_conv2d, counted_call
    return counts


@in_fresh_process
def test_decode_peak_is_activations_plus_one_band():
    arch, config = vae_flux2, vae_flux2.FLUX2_CONFIG
    mx.random.seed(0)
    model = arch.Model(arch.ModelArgs.from_dict(config))
    model.compute_dtype = mx.float32
    mx.eval(model.parameters())
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    z = mx.random.normal((1, model.args.latent_channels, SIZE // 8, SIZE // 8))
    mx.eval(z)
    convs = _counting_bands()
    with mlx_peak_above_live() as measured, installed(decide(RunPolicy(), model)):   # as the decode phase decides
        image = decode_array(model, z)                                                # on the CPU: paced, row bands
        mx.eval(image)
    peak = measured.bytes
    # the allowance: about four full-resolution activations of the widest full-resolution block (its input, a
    # normalised copy, a conv output, the residual: vae.Model.decode_bytes) plus one convolution band's buffer
    allowance = model.decode_bytes(z.shape, mx.float32) + CPU_CONV_BAND
    banded = sum(n > 1 for n in convs)
    print(f"{arch.__name__}: weights {weights / 2**30:.2f} GiB, decode peak above them {peak / 2**30:.2f} GiB, "
          f"allowance {allowance / 2**30:.2f} GiB; {banded} of {len(convs)} convolutions in bands")
    assert image.shape == (1, 3, SIZE, SIZE)
    assert banded > 0           # the decode's bound rests on its bands: the size still needs them
    assert peak <= allowance, (peak, allowance)
