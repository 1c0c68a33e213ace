//! The rendezvous of a run's processes at rank 0's `MASTER_ADDR:MASTER_PORT`, and the watch that
//! keeps every rank from waiting forever on one that has ended.
//!
//! Every other rank connects to rank 0 and says who it is (its rank, the world's size, and a
//! fingerprint of its config); once all have, rank 0 checks they agree and hands each the bytes
//! the collective library needs to join them (NCCL's unique id; nothing for MPI, which has its
//! own launcher). This is the bootstrap only, as `torchrun`'s store is: the gradients go through
//! the collective library.
//!
//! The connections stay open for the run. A rank that ends without saying it is done (killed,
//! or stopped by an error of its own) closes its connection; rank 0 sees that, tells the other
//! ranks which rank it was, and every rank ends with one `error:` line naming it, instead of
//! waiting inside a collective that can never complete. TCP keepalive notices a machine that
//! went away without closing anything within about half a minute.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::launcher::Ranks;
use crate::error::{Result, TrainError};

/// How long ranks wait for each other at the rendezvous when `EMBER_RENDEZVOUS_TIMEOUT`
/// (seconds) is not set.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// The first bytes of a rank's greeting, and the protocol's version.
const MAGIC: &[u8; 4] = b"EMB1";

/// A message on an open connection: this rank is done, cleanly.
const DONE: u8 = b'D';
/// A message from rank 0: the rank named next (4 bytes) ended; stop.
const LOST: u8 = b'X';
/// Rank 0's answer to a greeting: go on (with the payload) or stop (with a message).
const ACCEPT: u8 = b'K';
const REJECT: u8 = b'R';

/// The rendezvous timeout: `EMBER_RENDEZVOUS_TIMEOUT` seconds, else [`DEFAULT_TIMEOUT`].
pub fn timeout() -> Result<Duration> {
    match std::env::var("EMBER_RENDEZVOUS_TIMEOUT") {
        Ok(text) => text
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|s| s.is_finite() && *s > 0.0)
            .map(Duration::from_secs_f64)
            .ok_or_else(|| {
                TrainError::Distributed(format!(
                    "EMBER_RENDEZVOUS_TIMEOUT={text:?} is not a number of seconds above 0"
                ))
            }),
        Err(_) => Ok(DEFAULT_TIMEOUT),
    }
}

/// The open connections of a run's ranks: rank 0 holds one to every other rank, the others one
/// to rank 0.
pub struct Link {
    rank: usize,
    peers: Vec<(usize, TcpStream)>,
    /// Set when this rank says it is done: its watchers then stay quiet.
    finished: Arc<AtomicBool>,
}

impl Link {
    /// Meets the other ranks; `payload` is what rank 0 hands every other rank (and what they
    /// get back); `fingerprint` must be the same on every rank (the run's config).
    pub fn join(
        ranks: &Ranks,
        fingerprint: u64,
        payload: std::result::Result<&[u8], String>,
        timeout: Duration,
    ) -> Result<(Self, Vec<u8>)> {
        let addr = ranks.rendezvous_addr()?;
        let (peers, payload) = match ranks.is_main() {
            true => (
                serve(ranks, &addr, fingerprint, payload.clone(), timeout)?,
                payload.unwrap_or_default().to_vec(),
            ),
            false => {
                let (stream, payload) = greet(ranks, &addr, fingerprint, timeout)?;
                (vec![(0, stream)], payload)
            }
        };
        for (_, stream) in &peers {
            keepalive(stream);
        }
        let link = Self {
            rank: ranks.rank,
            peers,
            finished: Arc::new(AtomicBool::new(false)),
        };
        link.watch()?;
        Ok((link, payload))
    }

    /// Says this rank is done, cleanly: the others' watchers then take its closed connection
    /// for what it is.
    pub fn finish(&self) {
        self.finished.store(true, Ordering::SeqCst);
        for (_, stream) in &self.peers {
            let _ = (&*stream).write_all(&[DONE]);
        }
    }

    /// One thread per connection, reading until the peer says it is done; a connection that
    /// closes first ends this process with one line (after rank 0 has told the others).
    fn watch(&self) -> Result<()> {
        let others: Vec<(usize, TcpStream)> = self
            .peers
            .iter()
            .map(|(r, s)| s.try_clone().map(|s| (*r, s)))
            .collect::<std::io::Result<_>>()
            .map_err(|e| TrainError::Distributed(format!("rendezvous: {e}")))?;
        let others = Arc::new(others);
        for (peer, stream) in others.iter() {
            let (peer, mut stream) = (
                *peer,
                stream
                    .try_clone()
                    .map_err(|e| TrainError::Distributed(format!("rendezvous: {e}")))?,
            );
            let (me, finished, others) = (self.rank, self.finished.clone(), others.clone());
            std::thread::Builder::new()
                .name(format!("ember-watch-{peer}"))
                .spawn(move || {
                    let mut byte = [0u8; 1];
                    let lost = match stream.read_exact(&mut byte) {
                        Ok(()) if byte[0] == DONE => return,
                        Ok(()) if byte[0] == LOST => {
                            let mut which = [0u8; 4];
                            match stream.read_exact(&mut which) {
                                Ok(()) => u32::from_le_bytes(which) as usize,
                                Err(_) => peer,
                            }
                        }
                        _ => peer,
                    };
                    if finished.load(Ordering::SeqCst) {
                        return;
                    }
                    if me == 0 {
                        let mut message = vec![LOST];
                        message.extend((lost as u32).to_le_bytes());
                        for (_, s) in others.iter().filter(|(r, _)| *r != lost) {
                            let _ = (&*s).write_all(&message);
                        }
                    }
                    end_process(&format!(
                        "rank {lost} ended before the run did (killed, or stopped by an error of \
                         its own); rank {me} stops too"
                    ));
                })
                .map_err(|e| TrainError::Distributed(format!("rendezvous: {e}")))?;
        }
        Ok(())
    }
}

/// Prints `error: <message>` and ends the process at once: the training thread may be inside a
/// collective that cannot complete, and exit handlers (CUDA's, MPI's) could wait on it.
pub(crate) fn end_process(message: &str) -> ! {
    crate::error::print_error_line(message);
    // SAFETY: ends the process; nothing after it runs.
    unsafe { libc::_exit(1) }
}

/// Rank 0: listens, takes every other rank's greeting, checks them and answers each: with
/// `payload`, or, once anything is wrong (`payload` itself an error: rank 0 cannot start its
/// collective library), with what is wrong, to every rank that has come or still comes (until
/// all have, or the timeout), so that all end at once with the same line.
fn serve(
    ranks: &Ranks,
    addr: &str,
    fingerprint: u64,
    payload: std::result::Result<&[u8], String>,
    timeout: Duration,
) -> Result<Vec<(usize, TcpStream)>> {
    let deadline = Instant::now() + timeout;
    let port = ranks.master_port;
    let listener = TcpListener::bind(("0.0.0.0", port)).map_err(|e| {
        TrainError::Distributed(format!(
            "rank 0 cannot listen on port {port} for the rendezvous: {e} (another run on this \
             port? set MASTER_PORT)"
        ))
    })?;
    listener
        .set_nonblocking(true)
        .map_err(|e| TrainError::Distributed(format!("rendezvous on {addr}: {e}")))?;
    let mut failure: Option<String> = payload.clone().err();
    let (mut peers, mut arrived): (Vec<(usize, TcpStream)>, Vec<usize>) = (Vec::new(), Vec::new());
    while arrived.len() + 1 < ranks.size {
        let (mut stream, _) = match listener.accept() {
            Ok(accepted) => accepted,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() > deadline {
                    if let Some(failure) = failure {
                        return Err(TrainError::Distributed(failure));
                    }
                    let mut missing: Vec<usize> =
                        (1..ranks.size).filter(|r| !arrived.contains(r)).collect();
                    missing.truncate(8);
                    let missing: Vec<String> = missing.iter().map(|r| r.to_string()).collect();
                    return Err(TrainError::Distributed(format!(
                        "rendezvous on port {port}: rank {} did not join within {:.0} s \
                         (EMBER_RENDEZVOUS_TIMEOUT); {} of {} ranks arrived",
                        missing.join(", rank "),
                        timeout.as_secs_f64(),
                        arrived.len() + 1,
                        ranks.size
                    )));
                }
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            Err(e) => {
                return Err(TrainError::Distributed(format!(
                    "rendezvous on {addr}: {e}"
                )));
            }
        };
        let _ = stream.set_nonblocking(false);
        let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
        let Ok((rank, size, theirs)) = read_greeting(&mut stream) else {
            // Not a rank of ember's (a port scan, a stale client): not counted.
            continue;
        };
        let problem = if size != ranks.size {
            Some(format!(
                "rendezvous: rank {rank} was launched with {size} ranks, rank 0 with {}",
                ranks.size
            ))
        } else if rank == 0 || rank >= ranks.size || arrived.contains(&rank) {
            Some(format!("rendezvous: two processes claim rank {rank}"))
        } else if theirs != fingerprint {
            Some(format!(
                "rendezvous: rank {rank} trains another config than rank 0 (every rank needs \
                 the same config, overrides and run folder)"
            ))
        } else {
            None
        };
        arrived.push(rank);
        let _ = stream.set_read_timeout(None);
        peers.push((rank, stream));
        if failure.is_none()
            && let Some(problem) = problem
        {
            failure = Some(problem);
        }
        if let Some(failure) = &failure {
            // Everyone who has come hears it (and leaves); so will everyone who still comes.
            for (_, stream) in peers.drain(..) {
                let _ = answer(&stream, REJECT, failure.as_bytes());
            }
            if size != ranks.size {
                break;
            }
        }
    }
    if let Some(failure) = failure {
        return Err(TrainError::Distributed(failure));
    }
    let payload = payload.expect("no failure: the payload is there");
    for (rank, stream) in &peers {
        answer(stream, ACCEPT, payload).map_err(|e| {
            TrainError::Distributed(format!(
                "rendezvous: rank {rank} left before the start: {e}"
            ))
        })?;
    }
    peers.sort_by_key(|(r, _)| *r);
    Ok(peers)
}

/// Rank 0's answer to a greeting: `kind` and a body.
fn answer(mut stream: &TcpStream, kind: u8, body: &[u8]) -> std::io::Result<()> {
    let mut message = vec![kind];
    message.extend((body.len() as u32).to_le_bytes());
    message.extend(body);
    stream.write_all(&message)
}

/// Another rank: connects to rank 0 (trying again until `deadline`), greets it and reads its
/// answer.
fn greet(
    ranks: &Ranks,
    addr: &str,
    fingerprint: u64,
    timeout: Duration,
) -> Result<(TcpStream, Vec<u8>)> {
    let deadline = Instant::now() + timeout;
    let rank = ranks.rank;
    let unreachable = |why: String| {
        TrainError::Distributed(format!(
            "rank {rank} could not reach rank 0 at {addr} within {:.0} s \
             (EMBER_RENDEZVOUS_TIMEOUT): {why}",
            timeout.as_secs_f64()
        ))
    };
    let mut stream = loop {
        let last = match addr.to_socket_addrs() {
            Ok(mut addrs) => match addrs.next() {
                Some(a) => match TcpStream::connect_timeout(&a, Duration::from_secs(2)) {
                    Ok(stream) => break stream,
                    Err(e) => e.to_string(),
                },
                None => "no address".to_string(),
            },
            Err(e) => e.to_string(),
        };
        if Instant::now() > deadline {
            return Err(unreachable(last));
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let mut greeting = MAGIC.to_vec();
    greeting.extend((rank as u32).to_le_bytes());
    greeting.extend((ranks.size as u32).to_le_bytes());
    greeting.extend(fingerprint.to_le_bytes());
    stream
        .write_all(&greeting)
        .map_err(|e| unreachable(e.to_string()))?;
    // Rank 0 answers once every rank has arrived.
    let left = deadline.saturating_duration_since(Instant::now()) + Duration::from_secs(5);
    let _ = stream.set_read_timeout(Some(left));
    let mut kind = [0u8; 1];
    let mut len = [0u8; 4];
    stream
        .read_exact(&mut kind)
        .and_then(|()| stream.read_exact(&mut len))
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                TrainError::Distributed(format!(
                    "rank {rank}: the other ranks did not all join within the rendezvous timeout"
                ))
            }
            _ => TrainError::Distributed(format!(
                "rank {rank}: rank 0 ended during the rendezvous ({e})"
            )),
        })?;
    let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
    stream
        .read_exact(&mut body)
        .map_err(|e| TrainError::Distributed(format!("rank {rank}: rendezvous: {e}")))?;
    let _ = stream.set_read_timeout(None);
    match kind[0] {
        ACCEPT => Ok((stream, body)),
        _ => Err(TrainError::Distributed(
            String::from_utf8_lossy(&body).into_owned(),
        )),
    }
}

/// A greeting: (rank, size, fingerprint).
fn read_greeting(stream: &mut TcpStream) -> std::io::Result<(usize, usize, u64)> {
    let mut bytes = [0u8; 20];
    stream.read_exact(&mut bytes)?;
    if &bytes[..4] != MAGIC {
        return Err(std::io::Error::other("not a greeting"));
    }
    let word = |i: usize| u32::from_le_bytes(bytes[i..i + 4].try_into().unwrap()) as usize;
    let fingerprint = u64::from_le_bytes(bytes[12..20].try_into().unwrap());
    Ok((word(4), word(8), fingerprint))
}

/// TCP keepalive on `stream`: a peer whose machine went away is noticed within about 25 s
/// (idle 10 s, then 3 probes 5 s apart).
fn keepalive(stream: &TcpStream) {
    use std::os::fd::AsRawFd;
    let fd = stream.as_raw_fd();
    let set = |level: i32, name: i32, value: i32| {
        // SAFETY: setsockopt on an open socket with an int option.
        unsafe {
            libc::setsockopt(
                fd,
                level,
                name,
                &value as *const i32 as *const libc::c_void,
                size_of::<i32>() as libc::socklen_t,
            )
        };
    };
    set(libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1);
    set(libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, 10);
    set(libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, 5);
    set(libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 3);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ranks(rank: usize, size: usize, port: u16) -> Ranks {
        Ranks {
            rank,
            size,
            local_rank: rank,
            local_size: size,
            master_addr: Some("127.0.0.1".into()),
            master_port: port,
            launcher: "test",
        }
    }

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    /// Three ranks meet; rank 0's payload reaches both others; they finish cleanly.
    #[test]
    fn ranks_meet_and_get_rank_zero_s_payload() {
        let port = free_port();
        let t = Duration::from_secs(20);
        let workers: Vec<_> = (1..3)
            .map(|r| std::thread::spawn(move || Link::join(&ranks(r, 3, port), 7, Ok(&[]), t)))
            .collect();
        let (main, got) = Link::join(&ranks(0, 3, port), 7, Ok(b"id-bytes"), t).unwrap();
        assert_eq!(got, b"id-bytes");
        let links: Vec<Link> = workers
            .into_iter()
            .map(|w| {
                let (link, got) = w.join().unwrap().unwrap();
                assert_eq!(got, b"id-bytes");
                link
            })
            .collect();
        assert_eq!(main.peers.len(), 2);
        for link in &links {
            link.finish();
        }
        main.finish();
    }

    /// A rank with another config is refused at the start, on both sides, in one line.
    #[test]
    fn a_rank_with_another_config_is_refused() {
        let port = free_port();
        let t = Duration::from_secs(20);
        let worker = std::thread::spawn(move || Link::join(&ranks(1, 2, port), 8, Ok(&[]), t));
        let e = Link::join(&ranks(0, 2, port), 7, Ok(&[]), t)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("rank 1 trains another config"), "{e}");
        let e = worker.join().unwrap().err().unwrap().to_string();
        assert!(e.contains("rank 1 trains another config"), "{e}");
    }

    /// Rank 0 that cannot start its collective library tells every rank why, at once.
    #[test]
    fn rank_zero_s_failure_reaches_every_rank() {
        let port = free_port();
        let t = Duration::from_secs(20);
        let workers: Vec<_> = (1..3)
            .map(|r| std::thread::spawn(move || Link::join(&ranks(r, 3, port), 7, Ok(&[]), t)))
            .collect();
        let started = Instant::now();
        let why = "rank 0 cannot start NCCL: no libnccl".to_string();
        let e = Link::join(&ranks(0, 3, port), 7, Err(why.clone()), t)
            .err()
            .unwrap()
            .to_string();
        assert_eq!(e, why);
        for worker in workers {
            let e = worker.join().unwrap().err().unwrap().to_string();
            assert_eq!(e, why);
        }
        assert!(started.elapsed() < Duration::from_secs(10));
    }

    /// Nobody at rank 0's address: the rank gives up after the timeout, naming itself and it.
    #[test]
    fn a_missing_rank_zero_times_out_in_one_line() {
        let port = free_port();
        let started = Instant::now();
        let e = Link::join(&ranks(1, 2, port), 7, Ok(&[]), Duration::from_millis(500))
            .err()
            .unwrap()
            .to_string();
        assert!(started.elapsed() < Duration::from_secs(10));
        assert!(
            e.starts_with("rank 1 could not reach rank 0 at 127.0.0.1:"),
            "{e}"
        );
        // And rank 0 alone: it names the rank that did not come.
        let e = Link::join(&ranks(0, 3, port), 7, Ok(&[]), Duration::from_millis(300))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("rank 1, rank 2 did not join"), "{e}");
    }
}
