"""Studies: experiments that reproduce the paper's claims, the report, the command line, sweeps."""
