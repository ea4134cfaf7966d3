"""The method's parts: what LOPD is, independent of how it is trained -- losses and their KL
pieces, the fused LM head + NLL, the composer and its compressor, the latent splice, the
experience bank and its embedders, the text context, evaluation statistics, shared types,
shapes and defaults."""
