"""The pixels of one batch row, made the same way wherever they are made: the crop and eval
geometry and the resize filters (``geometry``), the JPEG region decoder (``regions``) and the one
function that turns an image's bytes and what was decided for it into a row (``render``). The
service's decode workers and a trainer that decodes encoded rows (NOTE [ Encoded rows ] in
``protocol/encoded.py``) both import it; it imports neither of them.
"""


class DecodeError(Exception):
    """A sample that cannot be read or decoded; ``str()`` is the reason logged and reported."""
