"""The sending wing: the reducers ForkingPickler calls (sender, arrow), their
registration (registry), the writers that tell the keeper a message is on
its way (channel), and arrays born in shared memory (allocator)."""
