//! Each command's flags (the clap types) and the validated settings they resolve to, in one
//! step: a flag that cannot be used is refused here, named as typed, before anything runs.
//!
//! [`flags`] maps the core's field names back to the flags that set them; [`tune`] holds
//! `tune`'s flags and settings (`run` tunes with the same).

pub mod flags;
pub mod tune;
