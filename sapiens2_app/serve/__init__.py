"""serve.py's parts: the HTTP server, uploads, the job queue, the attention explorer, and the page (static/). Imports
the library, common/ and predict/ (every job runs predict's inference and outputs)."""
