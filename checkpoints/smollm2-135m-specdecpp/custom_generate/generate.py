"""SpecDec++ decoding with the bundle in the folder above (hub ``custom_generate`` layout).

Written by ``accept_head.SpecDecPP.save_pretrained``; needs ``pip install accept-head``. Loading it through
transformers (``custom_generate=<this folder>``) runs this file and therefore needs your explicit
``trust_remote_code=True``; nothing in accept_head turns that on. transformers copies this file into its module cache,
so pass ``bundle=<folder>`` to ``generate`` when loading it that way.
"""

from pathlib import Path

from accept_head.specdecpp.bundle import bundle_generate


def generate(model, *args, bundle=None, **kwargs):
    """``model.generate(...)`` (the target) with SpecDec++ as the decoding loop; takes ``generate``'s arguments."""
    folder = Path(bundle) if bundle is not None else Path(__file__).resolve().parent.parent
    return bundle_generate(folder, model, *args, **kwargs)
