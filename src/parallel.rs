//! Elementwise work spread over the host's cores: buffers cut into one chunk per thread, each
//! chunk on its own scoped thread. Chunks smaller than `MIN_CHUNK` elements are not worth a
//! thread, so small buffers run on the calling thread.

/// Fewest elements per thread: below this, spawning costs more than the work.
const MIN_CHUNK: usize = 1 << 16;

/// Threads to spread a pass over: every core the process may use.
pub fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Chunk length for `len` elements over `threads` threads.
pub fn chunk_len(len: usize, threads: usize) -> usize {
    len.div_ceil(threads.max(1)).max(MIN_CHUNK)
}

/// Runs `f` on every item, one scoped thread per item except the last, which runs here.
pub fn run_parallel<I, F>(items: I, f: F)
where
    I: Iterator,
    I::Item: Send,
    F: Fn(I::Item) + Sync,
{
    let f = &f;
    std::thread::scope(|scope| {
        let mut pending = None;
        for item in items {
            if let Some(previous) = pending.replace(item) {
                scope.spawn(move || f(previous));
            }
        }
        if let Some(last) = pending {
            f(last);
        }
    });
}
