"""llama.cpp's `llama-server`, built from a pinned source and cached; tiny models and a server to run."""
