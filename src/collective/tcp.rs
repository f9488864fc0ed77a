//! A process group over TCP: rank 0 is the hub of a star, every other rank one connection to it.
//!
//! It exists so that data parallelism runs, and is tested, on machines without GPUs. A star
//! is slower than a ring for large buffers, but it sums in one fixed order on one rank —
//! `((x0 + x1) + x2) + …` — and sends that one result to everybody, so every rank ends with
//! the same bits, and the sum is the one a single process accumulating the same micro-batches
//! in the same order computes. Loopback bandwidth is far above what CPU training needs.
//!
//! Every message is a frame: a header (magic, operation, sequence number, payload bytes) and
//! the little-endian payload. The header catches ranks that disagree about which collective
//! comes next, which would otherwise exchange garbage silently.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use crate::{Error, Result};

const MAGIC: u32 = 0x4154_4450; // "ATDP"
const HEADER_BYTES: usize = 4 + 1 + 8 + 8;

/// How long ranks wait for each other at start-up (CUDA initialisation can take many seconds).
pub const JOIN_TIMEOUT: Duration = Duration::from_secs(120);

/// The collectives, as tagged on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Op {
    Hello = 1,
    Welcome = 2,
    SumF32 = 3,
    SumF64 = 4,
    Broadcast = 5,
}

/// Element types the group can sum: fixed width, little-endian on the wire.
pub trait WireElem: Copy + std::ops::AddAssign + Default {
    /// Bytes per element.
    const BYTES: usize;
    /// Appends the little-endian bytes.
    fn put(self, out: &mut Vec<u8>);
    /// Reads one element from exactly [`Self::BYTES`] bytes.
    fn get(bytes: &[u8]) -> Self;
}

impl WireElem for f32 {
    const BYTES: usize = 4;
    fn put(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_le_bytes());
    }
    fn get(bytes: &[u8]) -> Self {
        f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]])
    }
}

impl WireElem for f64 {
    const BYTES: usize = 8;
    fn put(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_le_bytes());
    }
    fn get(bytes: &[u8]) -> Self {
        let mut b = [0u8; 8];
        b.copy_from_slice(&bytes[..8]);
        f64::from_le_bytes(b)
    }
}

/// One rank's end of the star.
pub struct TcpGroup {
    rank: usize,
    world_size: usize,
    /// On rank 0, the connection to rank `i + 1` at index `i`; elsewhere, the one to rank 0.
    links: Vec<TcpStream>,
    /// Collectives completed, checked against every frame.
    sequence: u64,
}

impl TcpGroup {
    /// Joins the group: rank 0 listens on `addr` and waits for the others, which connect.
    pub fn join(rank: usize, world_size: usize, addr: SocketAddr) -> Result<Self> {
        let mut group = Self {
            rank,
            world_size,
            links: Vec::new(),
            sequence: 0,
        };
        if rank == 0 {
            let listener = TcpListener::bind(addr).map_err(|e| {
                group.failure(format!(
                    "cannot listen on {addr} ({e}); is another run using that port?"
                ))
            })?;
            group.accept_all(&listener)?;
        } else {
            group.connect(addr)?;
        }
        Ok(group)
    }

    /// Rank 0 with a listener the caller already bound (tests pick a free port this way).
    pub fn host(listener: &TcpListener, world_size: usize) -> Result<Self> {
        let mut group = Self {
            rank: 0,
            world_size,
            links: Vec::new(),
            sequence: 0,
        };
        group.accept_all(listener)?;
        Ok(group)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the group.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    fn failure(&self, problem: String) -> Error {
        Error::Collective {
            rank: self.rank,
            problem,
        }
    }

    fn accept_all(&mut self, listener: &TcpListener) -> Result<()> {
        let deadline = Instant::now() + JOIN_TIMEOUT;
        let mut slots: Vec<Option<TcpStream>> = (1..self.world_size).map(|_| None).collect();
        listener
            .set_nonblocking(true)
            .map_err(|e| self.failure(format!("cannot poll the listener ({e})")))?;
        while slots.iter().any(Option::is_none) {
            match listener.accept() {
                Ok((stream, _)) => {
                    stream
                        .set_nonblocking(false)
                        .and_then(|()| stream.set_nodelay(true))
                        .map_err(|e| {
                            self.failure(format!("cannot configure a connection ({e})"))
                        })?;
                    let (peer, world) = self.read_hello(&stream)?;
                    if world != self.world_size || peer == 0 || peer >= self.world_size {
                        return Err(self.failure(format!(
                            "a process joined as rank {peer} of {world}, but this group has {} ranks",
                            self.world_size
                        )));
                    }
                    if slots[peer - 1].replace(stream).is_some() {
                        return Err(self.failure(format!("rank {peer} joined twice")));
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    if Instant::now() > deadline {
                        let missing: Vec<String> = slots
                            .iter()
                            .enumerate()
                            .filter(|(_, s)| s.is_none())
                            .map(|(i, _)| (i + 1).to_string())
                            .collect();
                        return Err(self.failure(format!(
                            "ranks {} did not join within {} s",
                            missing.join(", "),
                            JOIN_TIMEOUT.as_secs()
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => return Err(self.failure(format!("accept failed ({e})"))),
            }
        }
        self.links = slots.into_iter().flatten().collect();
        // Everyone is here: release the waiting ranks together.
        for peer in 1..self.world_size {
            self.send(peer, Op::Welcome, &[])?;
        }
        Ok(())
    }

    fn read_hello(&self, mut stream: &TcpStream) -> Result<(usize, usize)> {
        let mut bytes = [0u8; HEADER_BYTES + 16];
        stream
            .read_exact(&mut bytes)
            .map_err(|e| self.failure(format!("a joining process sent no greeting ({e})")))?;
        let (op, _, len) = parse_header(&bytes[..HEADER_BYTES]).ok_or_else(|| {
            self.failure("a process that is not an autotune rank connected".into())
        })?;
        if op != Op::Hello as u8 || len != 16 {
            return Err(self.failure("a joining process sent a malformed greeting".into()));
        }
        let word = |i: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&bytes[HEADER_BYTES + 8 * i..HEADER_BYTES + 8 * i + 8]);
            u64::from_le_bytes(b) as usize
        };
        Ok((word(0), word(1)))
    }

    fn connect(&mut self, addr: SocketAddr) -> Result<()> {
        let deadline = Instant::now() + JOIN_TIMEOUT;
        let stream = loop {
            match TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
                Ok(stream) => break stream,
                Err(e) if Instant::now() > deadline => {
                    return Err(self.failure(format!(
                        "cannot reach rank 0 at {addr} within {} s ({e})",
                        JOIN_TIMEOUT.as_secs()
                    )))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        };
        stream
            .set_nodelay(true)
            .map_err(|e| self.failure(format!("cannot configure the connection ({e})")))?;
        self.links = vec![stream];
        let mut hello = Vec::with_capacity(16);
        hello.extend_from_slice(&(self.rank as u64).to_le_bytes());
        hello.extend_from_slice(&(self.world_size as u64).to_le_bytes());
        self.send(0, Op::Hello, &hello)?;
        self.receive(0, Op::Welcome, 0)?;
        Ok(())
    }

    fn link(&self, peer: usize) -> &TcpStream {
        if self.rank == 0 {
            &self.links[peer - 1]
        } else {
            &self.links[0]
        }
    }

    fn send(&self, peer: usize, op: Op, payload: &[u8]) -> Result<()> {
        let mut header = Vec::with_capacity(HEADER_BYTES);
        header.extend_from_slice(&MAGIC.to_le_bytes());
        header.push(op as u8);
        header.extend_from_slice(&self.sequence.to_le_bytes());
        header.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        let mut link = self.link(peer);
        link.write_all(&header)
            .and_then(|()| link.write_all(payload))
            .map_err(|e| self.lost(peer, e))
    }

    /// Reads a frame of `op` with `len` payload bytes from `peer`.
    fn receive(&self, peer: usize, op: Op, len: usize) -> Result<Vec<u8>> {
        let mut link = self.link(peer);
        let mut header = [0u8; HEADER_BYTES];
        link.read_exact(&mut header)
            .map_err(|e| self.lost(peer, e))?;
        let (got_op, sequence, got_len) = parse_header(&header)
            .ok_or_else(|| self.failure(format!("rank {peer} sent a corrupt frame")))?;
        if got_op != op as u8 || sequence != self.sequence || got_len != len as u64 {
            return Err(self.failure(format!(
                "rank {peer} is out of step: expected operation {} #{} of {len} bytes, got operation {got_op} #{sequence} of {got_len} bytes",
                op as u8, self.sequence
            )));
        }
        let mut payload = vec![0u8; len];
        link.read_exact(&mut payload)
            .map_err(|e| self.lost(peer, e))?;
        Ok(payload)
    }

    fn lost(&self, peer: usize, e: std::io::Error) -> Error {
        let peer = if self.rank == 0 { peer } else { 0 };
        self.failure(format!(
            "lost the connection to rank {peer} ({e}); did it exit?"
        ))
    }

    /// Sums `values` over all ranks, in rank order, leaving the same result on every rank.
    pub fn all_reduce_sum<T: WireElem>(&mut self, values: &mut [T]) -> Result<()> {
        let op = if T::BYTES == 4 {
            Op::SumF32
        } else {
            Op::SumF64
        };
        let len = values.len() * T::BYTES;
        if self.rank == 0 {
            for peer in 1..self.world_size {
                let bytes = self.receive(peer, op, len)?;
                for (v, chunk) in values.iter_mut().zip(bytes.chunks_exact(T::BYTES)) {
                    *v += T::get(chunk);
                }
            }
            let bytes = encode(values);
            for peer in 1..self.world_size {
                self.send(peer, op, &bytes)?;
            }
        } else {
            self.send(0, op, &encode(values))?;
            decode_into(&self.receive(0, op, len)?, values);
        }
        self.sequence += 1;
        Ok(())
    }

    /// Replaces `values` on every rank with those of rank `root`.
    pub fn broadcast(&mut self, values: &mut [f32], root: usize) -> Result<()> {
        let len = values.len() * 4;
        if self.rank == 0 {
            if root != 0 {
                decode_into(&self.receive(root, Op::Broadcast, len)?, values);
            }
            let bytes = encode(values);
            for peer in (1..self.world_size).filter(|&p| p != root) {
                self.send(peer, Op::Broadcast, &bytes)?;
            }
        } else if self.rank == root {
            self.send(0, Op::Broadcast, &encode(values))?;
        } else {
            decode_into(&self.receive(0, Op::Broadcast, len)?, values);
        }
        self.sequence += 1;
        Ok(())
    }
}

fn parse_header(bytes: &[u8]) -> Option<(u8, u64, u64)> {
    let word = |at: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&bytes[at..at + 8]);
        u64::from_le_bytes(b)
    };
    let magic = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
    (magic == MAGIC).then(|| (bytes[4], word(5), word(13)))
}

fn encode<T: WireElem>(values: &[T]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * T::BYTES);
    values.iter().for_each(|v| v.put(&mut out));
    out
}

fn decode_into<T: WireElem>(bytes: &[u8], values: &mut [T]) {
    for (v, chunk) in values.iter_mut().zip(bytes.chunks_exact(T::BYTES)) {
        *v = T::get(chunk);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `body` on `world` ranks in threads of this process, rank 0 on a free port.
    pub(crate) fn with_group<R: Send + 'static>(
        world: usize,
        body: impl Fn(TcpGroup) -> R + Send + Sync + 'static,
    ) -> Vec<R> {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let body = std::sync::Arc::new(body);
        let mut handles = Vec::new();
        for rank in 1..world {
            let body = body.clone();
            handles.push(std::thread::spawn(move || {
                body(TcpGroup::join(rank, world, addr).unwrap())
            }));
        }
        let root = body(TcpGroup::host(&listener, world).unwrap());
        let mut out = vec![root];
        out.extend(handles.into_iter().map(|h| h.join().unwrap()));
        out
    }

    #[test]
    fn sums_in_rank_order_and_every_rank_gets_the_same_bits() {
        // 1e8 + 1 − 1e8 depends on the order: in rank order it is (1e8 + 1) + (−1e8) = 0 in f32.
        let results = with_group(3, |mut g| {
            let mut v = [[1e8f32, 1.0, -1e8][g.rank()], g.rank() as f32];
            g.all_reduce_sum(&mut v).unwrap();
            let mut d = [0.5f64 * g.rank() as f64];
            g.all_reduce_sum(&mut d).unwrap();
            (v, d)
        });
        let expected = [(1e8f32 + 1.0) + -1e8, 3.0];
        for (v, d) in &results {
            assert_eq!(v.map(f32::to_bits), expected.map(f32::to_bits));
            assert_eq!(d[0], 1.5);
        }
    }

    #[test]
    fn broadcast_copies_the_roots_values() {
        let results = with_group(3, |mut g| {
            let mut v = [g.rank() as f32; 4];
            g.broadcast(&mut v, 2).unwrap();
            let mut w = [g.rank() as f32 + 10.0; 2];
            g.broadcast(&mut w, 0).unwrap();
            (v, w)
        });
        assert!(results
            .iter()
            .all(|(v, w)| *v == [2.0; 4] && *w == [10.0; 2]));
    }

    #[test]
    fn a_rank_that_leaves_is_reported_by_the_others() {
        let results = with_group(2, |mut g| {
            if g.rank() == 1 {
                return None;
            }
            let mut v = [1.0f32];
            Some(g.all_reduce_sum(&mut v).unwrap_err().to_string())
        });
        let message = results[0].as_ref().unwrap();
        assert!(
            message.contains("rank 0") && message.contains("lost the connection to rank 1"),
            "{message}"
        );
    }
}
