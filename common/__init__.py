"""Shared harness for every stage: GPU/track detection, argument checks, torch <-> CuTe
wrapping, compile caching and compile-only reports, seeded inputs, references, the checker,
benchmarking and plotting. Stage files import from here; nothing here is copied into them."""
