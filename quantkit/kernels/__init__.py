"""quantkit's own C++ CPU kernel, below the formats so the quantizer and the runtime share one build.

Modules: build (compile csrc/ into a cached extension module, load it), cpu (the loaded module with its
instruction set chosen, the QUANTKIT_CPU_ISA switch, `python -m quantkit.kernels.cpu build`), quant (the
quantizer's int4 and int8 ops, which formats/int4.py and int8.py call). The runtime's side (repacking the
stored codes into the kernel's tiles, its calls) is quantkit/runtime/cpu_kernel.py.
"""
