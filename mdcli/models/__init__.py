"""Where the weights come from: loading (hub id, folder, .gguf, the embedded package), architectures, GGUF files, memory."""
