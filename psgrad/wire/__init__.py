"""Both ends of the wire: protocol constants, payload frames, proto conversions, same-host segments."""
