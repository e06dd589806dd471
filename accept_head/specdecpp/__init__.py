"""What a user decodes with: the SpecDecPP bundle (target + draft + head + threshold as one folder), the
`model.generate(custom_generate=...)` integration and the terminal chat."""
