def from_pretrained(*a, **k): raise NotImplementedError
def export_pretrained(*a, **k): raise NotImplementedError
def load_tokenizer(*a, **k): raise NotImplementedError
