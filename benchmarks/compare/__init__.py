"""cpullm side by side with llama.cpp and transformers: same checkpoint, prompt and threads.

    python -m benchmarks.compare smollm2-135m-instruct [--threads 2] [--prompt-tokens 512]
        [--gen-tokens 128] [--repeat 3] [--rounds 1] [--paired 0] [--out DIR]
        [--skip llama.cpp,transformers] [--four-bit [--kl-prompts 1] [--kl-tokens 16] [--gguf-q4 FILE]]
        [--llama-convert]

Each runtime runs in its own child process on the same token ids, measured by the same harness
(``cpullm.bench.measure_speed``); llama.cpp runs its own quantization of the very checkpoint cpullm
runs. What is measured and how: benchmarks/README.md, "compare: the method".

The files, in the order of a run: gguf.py (the checkpoint as a GGUF, llama.cpp's quantizer),
llama_convert.py (llama.cpp's own converter, the GGUFs kept per checkpoint), workers.py (one
runtime measured in a child process), paired.py (the runtimes alive at once, taking turns),
report.py (compare.md / .png / .json), cli.py (the arguments and the run's steps).
"""
