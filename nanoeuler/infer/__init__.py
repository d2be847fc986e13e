"""Using a trained model: sampling and generation with the KV cache (sampling, generate), the interactive
REPL (chat), and the OpenAI-compatible server with its scheduler and web page (serve, scheduler, web/)."""
