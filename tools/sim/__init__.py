"""`sluice sim`: simulated OpenAI-compatible upstreams and the stand-ins of vLLM, TGI, Ollama and llama.cpp."""
