"""Making cartridges: corpus -> seed prompts -> synthesis -> dataset -> training (or compaction) -> Cartridge."""
