"""What the command-line tools share: parsing of options that the API takes as values."""

from .errors import MlxdiffError


def parse_quantize(text):
    """"4" -> 4; "transformer=4,text_encoder_3=8" -> {"transformer": 4, "text_encoder_3": 8}."""
    if text is None:
        return None
    try:
        if "=" not in text:
            return int(text)
        return {k.strip(): int(v) for k, v in (item.split("=") for item in text.split(","))}
    except ValueError:
        raise MlxdiffError(f"--quantize {text!r}: expected bits (e.g. 4) or component=bits pairs "
                           "(e.g. transformer=4,text_encoder_3=8)") from None
