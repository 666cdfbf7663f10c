"""vLLM inference: the server's lifecycle, a resumable async client, evaluation and adapter parity."""
