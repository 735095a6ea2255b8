"""Images in: what a request carries beside its tokens (inputs), the scheduler's encoder
cache (encoder_cache), and the frontend's model processors (processor)."""
