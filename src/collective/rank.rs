//! Who a rank is and how it finds the others: the three environment variables a launcher sets
//! on each child process.
//!
//! Environment variables rather than command-line flags, because the same mechanism then
//! serves every command a rank can run (`train`, `probe-one`) without teaching each of them
//! hidden flags, and the child's own arguments stay exactly the user's.

use std::fmt;
use std::net::SocketAddr;
use std::process::Command;

use crate::{Error, Result};

/// The rank of this process (0-based).
pub const RANK_ENV: &str = "AUTOTUNE_DP_RANK";
/// How many ranks there are.
pub const WORLD_SIZE_ENV: &str = "AUTOTUNE_DP_WORLD_SIZE";
/// Where the ranks meet: `tcp:HOST:PORT` or `nccl:<256 hex digits>`.
pub const RENDEZVOUS_ENV: &str = "AUTOTUNE_DP_RENDEZVOUS";

/// Bytes of an NCCL unique id (`ncclUniqueId`).
pub const NCCL_ID_BYTES: usize = 128;

/// How the ranks meet and which backend carries their traffic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rendezvous {
    /// TCP: rank 0 listens on this address, the others connect to it.
    Tcp(SocketAddr),
    /// NCCL: the unique id the launcher created, identical for every rank.
    Nccl([u8; NCCL_ID_BYTES]),
}

impl Rendezvous {
    /// Parses the form [`Rendezvous`]'s `Display` writes.
    pub fn parse(text: &str) -> Result<Self> {
        let bad = |problem: String| Error::invalid("environment", RENDEZVOUS_ENV, problem);
        if let Some(addr) = text.strip_prefix("tcp:") {
            let addr = addr
                .parse()
                .map_err(|e| bad(format!("`{addr}` is not HOST:PORT ({e})")))?;
            return Ok(Rendezvous::Tcp(addr));
        }
        if let Some(hex) = text.strip_prefix("nccl:") {
            if hex.len() != 2 * NCCL_ID_BYTES || !hex.is_ascii() {
                return Err(bad(format!(
                    "an NCCL id is {} hex digits, got {}",
                    2 * NCCL_ID_BYTES,
                    hex.len()
                )));
            }
            let mut id = [0u8; NCCL_ID_BYTES];
            for (i, byte) in id.iter_mut().enumerate() {
                *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16)
                    .map_err(|e| bad(format!("the NCCL id is not hex ({e})")))?;
            }
            return Ok(Rendezvous::Nccl(id));
        }
        Err(bad(format!("`{text}`: expected tcp:HOST:PORT or nccl:HEX")))
    }
}

impl fmt::Display for Rendezvous {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Rendezvous::Tcp(addr) => write!(f, "tcp:{addr}"),
            Rendezvous::Nccl(id) => {
                f.write_str("nccl:")?;
                id.iter().try_for_each(|b| write!(f, "{b:02x}"))
            }
        }
    }
}

/// One rank's identity, as its launcher handed it over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankEnv {
    /// This rank, `0..world_size`.
    pub rank: usize,
    /// Ranks in the group.
    pub world_size: usize,
    /// Where they meet.
    pub rendezvous: Rendezvous,
}

impl RankEnv {
    /// The rank this process was started as, or `None` when no launcher started it.
    pub fn from_env() -> Result<Option<Self>> {
        let Ok(rank) = std::env::var(RANK_ENV) else {
            return Ok(None);
        };
        let number = |name: &'static str, text: &str| {
            text.parse::<usize>().map_err(|_| {
                Error::invalid("environment", name, format!("`{text}` is not a number"))
            })
        };
        let world = std::env::var(WORLD_SIZE_ENV).map_err(|_| {
            Error::invalid(
                "environment",
                WORLD_SIZE_ENV,
                format!("is unset but {RANK_ENV} is set"),
            )
        })?;
        let rendezvous = std::env::var(RENDEZVOUS_ENV).map_err(|_| {
            Error::invalid(
                "environment",
                RENDEZVOUS_ENV,
                format!("is unset but {RANK_ENV} is set"),
            )
        })?;
        let env = Self {
            rank: number(RANK_ENV, &rank)?,
            world_size: number(WORLD_SIZE_ENV, &world)?,
            rendezvous: Rendezvous::parse(&rendezvous)?,
        };
        if env.rank >= env.world_size {
            return Err(Error::invalid(
                "environment",
                RANK_ENV,
                format!("is {} but the world size is {}", env.rank, env.world_size),
            ));
        }
        Ok(Some(env))
    }

    /// Sets the variables on a child's command.
    pub fn apply(&self, command: &mut Command) {
        command
            .env(RANK_ENV, self.rank.to_string())
            .env(WORLD_SIZE_ENV, self.world_size.to_string())
            .env(RENDEZVOUS_ENV, self.rendezvous.to_string());
    }
}

/// The device name a rank opens: rank `r` of a `cuda` run pins `cuda:r`; CPU ranks share the CPU.
pub fn rank_device(device: &str, rank: usize) -> String {
    match device {
        "cuda" | "auto" if crate::backend::cuda_device_count() > 0 => format!("cuda:{rank}"),
        "cuda" => format!("cuda:{rank}"),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rendezvous_round_trips_through_text() {
        let tcp = Rendezvous::Tcp("127.0.0.1:4567".parse().unwrap());
        assert_eq!(Rendezvous::parse(&tcp.to_string()).unwrap(), tcp);
        let mut id = [0u8; NCCL_ID_BYTES];
        id.iter_mut()
            .enumerate()
            .for_each(|(i, b)| *b = (i * 3) as u8);
        let nccl = Rendezvous::Nccl(id);
        assert_eq!(Rendezvous::parse(&nccl.to_string()).unwrap(), nccl);
        for bad in ["udp:1", "tcp:nohost", "nccl:12"] {
            let err = Rendezvous::parse(bad).unwrap_err().to_string();
            assert!(err.contains(RENDEZVOUS_ENV), "{err}");
        }
    }

    #[test]
    fn cpu_ranks_share_the_cpu_and_cuda_ranks_pin_one_gpu_each() {
        assert_eq!(rank_device("cpu", 3), "cpu");
        assert_eq!(rank_device("cuda", 3), "cuda:3");
    }
}
