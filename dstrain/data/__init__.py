"""Data: prompts → regenerated conversations → token ids + loss masks → webdataset shards → loader."""
