"""The thin Trio HTTP/1.1 layer (server and pooled upstream client), the OpenAI data plane and the control-side app."""
