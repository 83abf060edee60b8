"""What a token is drawn from and how: the sampling ops (temperature, top-k / top-p / min-p, seeded generators), penalties and logit bias, structured-output grammars, and prompt scoring."""
