"""The HTTP face of pipeplan (``pipeplan serve``): a FastAPI control plane that keeps jobs in
a database and runs each job's work as a Ray Job that reports back through the control
endpoint (``../shared/API.md``)."""
