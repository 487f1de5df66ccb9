"""Images: the Docker engine (the one module that talks to it), streaming an image's layers
and files without exporting it, the facts read from them (vLLM, CUDA, tools), image
references, and the ledger of what this tool created."""
