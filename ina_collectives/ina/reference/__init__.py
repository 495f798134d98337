"""The NumPy reference of the compiled kernels in _fast/: the same functions, the same
bits. ``blockfp`` mirrors _fast/blockfp.pyx (quantization), ``packet`` mirrors
_fast/packet.pyx (packetization). Tests hold the compiled kernels to these."""
